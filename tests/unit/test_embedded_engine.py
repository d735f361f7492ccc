"""Tests of the embedded inference engine on a tiny random Llama with the real SmolLM2 tokenizer.

Every expectation comes from an independent computation: `model.generate`, a full forward over
prompt + output, or the same engine serving one request at a time.
"""

import asyncio
import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from RL2.engine.embedded import engine as embedded_engine
from RL2.engine.embedded import model_runner
from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.engine.embedded.sampling import SamplingParams, sample_next_tokens
from RL2.models.default_model import resolve_model_path
from RL2.native import decode_kernels

PROMPTS = [[1, 9690, 198, 2683, 359, 253], [520, 9531], [4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 42, 77], [3365]]


def tiny_llama(vocab_size: int, seed: int, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        **config,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=0)


@pytest.fixture(scope="module", params=[True, False], ids=["forwards-on-the-loop", "forwards-in-a-worker-thread"])
def engine(request, model, tokenizer):
    with pytest.MonkeyPatch.context() as patch:  # where the forwards run follows the cores: try both
        patch.setattr(embedded_engine, "threads_fit_in_cores", lambda: request.param)
        engine = EmbeddedEngine(model, tokenizer, max_running_requests=16)
    assert engine.steps_on_loop == request.param
    yield engine
    engine.shutdown()


def test_forwards_leave_the_loop_when_threads_outnumber_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert embedded_engine.threads_fit_in_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not embedded_engine.threads_fit_in_cores()


def payload(prompt, **sampling) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True} | sampling
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def generate(engine, *payloads) -> list[dict]:
    async def main():
        return await asyncio.gather(*(engine.generate(p) for p in payloads))

    return asyncio.run(main())


def hf_greedy(model, prompt, n) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def full_logits(model, prompt, output) -> torch.Tensor:
    """Logits predicting each output token, from one forward over prompt + output."""
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1]


def test_greedy_matches_hf_generate(engine, model):
    results = generate(engine, *(payload(p) for p in PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result["output_ids"] == hf_greedy(model, prompt, 12)
        meta = result["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12


def test_the_callers_model_keeps_its_own_kernels(monkeypatch, model, tokenizer):
    """On the path through HF's modules (models outside the Llama families), the engine's decode
    attention and packed linears apply to its own forwards only: the model it was handed (here also
    the tests' reference) runs HF's kernels outside them."""
    monkeypatch.setattr(model_runner, "llama_forward_supported", lambda model: False)
    engine = EmbeddedEngine(model, tokenizer, max_running_requests=4)
    try:
        assert engine.runner.llama is None
        implementation = model.config._attn_implementation
        result = generate(engine, payload(PROMPTS[0]))[0]
    finally:
        engine.shutdown()
    assert result["output_ids"] == hf_greedy(model, PROMPTS[0], 12)
    assert model.config._attn_implementation == implementation
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert engine.runner.packed, "the engine packs its linear layers on a CPU"


def test_logprobs_are_the_models_at_the_sampling_temperature(engine, model):
    """log softmax(logits / T) of the sampled tokens, the model's own logits divided by T: the policy the
    trainer trains at that temperature (SGLang's default too)."""
    prompt = PROMPTS[2]
    for temperature in (1.0, 0.7, 1.5):
        result = generate(engine, payload(prompt, temperature=temperature, max_new_tokens=16))[0]
        logprobs = result["meta_info"]["output_token_logprobs"]
        assert [token for _, token, _ in logprobs] == result["output_ids"]
        expected = torch.log_softmax(full_logits(model, prompt, result["output_ids"]) / temperature, dim=-1)
        expected = expected.gather(1, torch.tensor(result["output_ids"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in logprobs]), expected, atol=1e-4, rtol=0)


def test_concurrent_requests_match_one_at_a_time(engine):
    payloads = [
        payload(PROMPTS[i % 4] + [100 + i] * (i % 3), max_new_tokens=4 + 3 * i) for i in range(10)
    ]
    alone = [generate(engine, p)[0]["output_ids"] for p in payloads]
    together = [r["output_ids"] for r in generate(engine, *payloads)]
    assert together == alone
    assert [len(ids) for ids in together] == [4 + 3 * i for i in range(10)]


def test_requests_beyond_capacity_join_the_running_batch_later(engine, model, tokenizer):
    payloads = [payload(PROMPTS[i % 4] + [200 + i], max_new_tokens=3 + 2 * i) for i in range(8)]
    alone = [generate(engine, p)[0]["output_ids"] for p in payloads]
    # 3 rows and a 40-token budget: most requests wait and are prefilled while others decode.
    small = EmbeddedEngine(model, tokenizer, max_running_requests=3, max_total_tokens=40)
    try:
        together = [r["output_ids"] for r in generate(small, *payloads)]
        with pytest.raises(ValueError, match="max_total_tokens"):
            generate(small, payload(PROMPTS[0], max_new_tokens=100))
    finally:
        small.shutdown()
    assert together == alone


@pytest.mark.parametrize("quiet", [0.0, 1.0])
def test_a_request_arriving_within_arrival_quiet_joins_the_first_prefill(engine, monkeypatch, quiet):
    """With `arrival_quiet` (set by the agent endpoint, whose calls arrive apart over HTTP) a request made 20 ms
    after another shares its prefill; without it the first step starts after one turn of the loop, and the later
    request is prefilled on its own."""
    prefills, admit = [], engine._admit

    def counted_admit():
        admitted = admit()
        if admitted:
            prefills.append(len(admitted))
        return admitted

    monkeypatch.setattr(engine, "_admit", counted_admit)
    monkeypatch.setattr(embedded_engine, "MAX_ARRIVAL_WAIT", 60.0)  # the quiet time alone ends the wait
    monkeypatch.setattr(engine, "arrival_quiet", quiet)

    async def main():
        first = asyncio.create_task(engine.generate(payload(PROMPTS[0], max_new_tokens=4)))
        await asyncio.sleep(0.02)
        return await asyncio.gather(first, engine.generate(payload(PROMPTS[1], max_new_tokens=4)))

    asyncio.run(main())
    assert prefills == ([2] if quiet else [1, 1])


def test_shared_prompt_prefix_is_exact(engine, model):
    # 20 shared tokens: the engine forwards them once and copies their keys/values to every row.
    prefix = PROMPTS[0] + PROMPTS[2] + [5356, 5646, 11173]
    prompts = [prefix + [198, 1, 4093 + i] * (1 + i % 3) for i in range(5)] + [prefix + [7]] * 2
    results = generate(engine, *(payload(p, max_new_tokens=8) for p in prompts))
    assert [r["output_ids"] for r in results] == [hf_greedy(model, p, 8) for p in prompts]


def test_identical_prompts_in_one_batch_equal_a_lone_request(engine, model):
    # Forwarded once per distinct prompt, rows copied: the same tokens and log-probabilities.
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    together = generate(engine, *(payload(p) for p in prompts))
    alone = {tuple(p): generate(engine, payload(p))[0] for p in PROMPTS[:3]}
    for prompt, result in zip(prompts, together):
        assert result["output_ids"] == hf_greedy(model, prompt, 12)
        expected = alone[tuple(prompt)]["meta_info"]["output_token_logprobs"]
        torch.testing.assert_close(result["meta_info"]["output_token_logprobs"], expected, atol=1e-5, rtol=0)


def test_a_groups_responses_read_their_prompt_once_with_the_same_outputs(tokenizer, monkeypatch):
    """A GRPO group's responses hold copies of one prompt, and prompts with a common system prefix copies of
    that: the C decode attention reads each once for all the rows that hold it. The sampled tokens and
    log-probabilities equal, bit for bit, those of rows that each read their own copy, also while rows finish
    at different steps and the others move into their places."""
    if decode_kernels.load_decode_kernels() is None:
        pytest.skip("the C decode kernels are unavailable here")
    model = tiny_llama(len(tokenizer), seed=3, head_dim=64)  # a head_dim the kernels read in whole vectors
    system = PROMPTS[0] + PROMPTS[2] + [5356, 5646, 11173]  # 20 tokens
    grouped = [system + PROMPTS[2] * 2, system + PROMPTS[1] * 5]  # 4 responses each
    alone = [system + [198, 1, 4093 + i] * (1 + i) for i in range(3)]  # 1 response each
    requests = [payload(prompt, temperature=1.0, max_new_tokens=3 + 4 * i, sampling_seed=10 * g + i)
                for g, prompt in enumerate(grouped) for i in range(4)]
    requests += [payload(prompt, temperature=1.0, max_new_tokens=5 + 2 * i, sampling_seed=i)
                 for i, prompt in enumerate(alone)]
    shared_spans = set()
    attention = decode_kernels.DecodeKernels.decode_attention

    def recording(self, *args, **kwargs):
        if args[-1] is not None:
            shared_spans.update(args[-1].shared.tolist())
        return attention(self, *args, **kwargs)

    monkeypatch.setattr(decode_kernels.DecodeKernels, "decode_attention", recording)
    outputs = {}
    for share in (True, False):
        engine = EmbeddedEngine(model, tokenizer, max_running_requests=16)
        engine.runner.cache.share_prompt_reads = share
        outputs[share] = generate(engine, *requests)
        engine.shutdown()
    assert {len(p) for p in grouped} | {len(system)} <= shared_spans, "some prompt copies were not read as one"
    for together, apart in zip(outputs[True], outputs[False]):
        assert together["output_ids"] == apart["output_ids"]
        assert together["meta_info"]["output_token_logprobs"] == apart["meta_info"]["output_token_logprobs"]


def test_stop_string_trims_text_but_keeps_tokens(engine, tokenizer):
    full = generate(engine, payload(PROMPTS[0], max_new_tokens=20))[0]
    stop = tokenizer.decode(full["output_ids"][6:8])
    cut = full["text"].find(stop)
    assert stop.strip() and cut >= 0

    result = generate(engine, payload(PROMPTS[0], max_new_tokens=20, stop=[stop]))[0]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["text"] == full["text"][:cut]
    n = len(result["output_ids"])
    assert n <= 8 and result["output_ids"] == full["output_ids"][:n]
    assert stop in tokenizer.decode(result["output_ids"])

    kept = generate(engine, payload(PROMPTS[0], max_new_tokens=20, stop=stop, no_stop_trim=True))[0]
    assert kept["text"] == full["text"][: cut + len(stop)]


def test_stop_token_ids_and_eos(model, tokenizer, engine):
    full = generate(engine, payload(PROMPTS[1], max_new_tokens=20))[0]["output_ids"]
    stop_token = full[5]
    n = full.index(stop_token) + 1

    result = generate(engine, payload(PROMPTS[1], max_new_tokens=20, ignore_eos=False, stop_token_ids=[stop_token]))[0]
    assert result["output_ids"] == full[:n]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert result["text"] == tokenizer.decode(full[: n - 1], skip_special_tokens=True)
    # min_new_tokens forbids the stop token until enough tokens exist.
    later = payload(PROMPTS[1], max_new_tokens=20, ignore_eos=False, stop_token_ids=[stop_token], min_new_tokens=n + 1)
    later = generate(engine, later)[0]
    assert len(later["output_ids"]) > n and stop_token not in later["output_ids"][:n]

    # An eos id from the model's generation_config stops unless ignore_eos (which, as in SGLang,
    # also switches off stop_token_ids).
    eos_model = copy.deepcopy(model)
    eos_model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_token]
    eos_engine = EmbeddedEngine(eos_model, tokenizer)
    try:
        stopped, ignored = generate(
            eos_engine,
            payload(PROMPTS[1], max_new_tokens=20, ignore_eos=False),
            payload(PROMPTS[1], max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
        )
    finally:
        eos_engine.shutdown()
    assert stopped["output_ids"] == full[:n]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert ignored["output_ids"] == full
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_top_k_and_top_p_sampling(engine, model):
    prompt = PROMPTS[0]
    greedy = generate(engine, payload(prompt, max_new_tokens=16))[0]["output_ids"]
    top1 = generate(engine, payload(prompt, max_new_tokens=16, temperature=1.0, top_k=1))[0]
    assert top1["output_ids"] == greedy

    samples = generate(engine, *(payload(prompt, max_new_tokens=16, temperature=1.5, top_k=3) for _ in range(4)))
    for sample in samples:
        top3 = full_logits(model, prompt, sample["output_ids"]).topk(3, dim=-1).indices
        assert (top3 == torch.tensor(sample["output_ids"])[:, None]).any(dim=-1).all()
    assert len({tuple(s["output_ids"]) for s in samples}) > 1  # it did sample

    nucleus = generate(engine, *(payload(prompt, max_new_tokens=16, temperature=0.5, top_p=0.2) for _ in range(4)))
    for sample in nucleus:
        probs = torch.softmax(full_logits(model, prompt, sample["output_ids"]) / 0.5, dim=-1)
        chosen = probs.gather(1, torch.tensor(sample["output_ids"])[:, None])
        mass_before = (probs * (probs > chosen)).sum(dim=-1)  # of the tokens likelier than the chosen one
        assert (mass_before <= 0.2 + 1e-4).all()


def test_sampler_draws_from_the_requested_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    rows = 20000
    generator = torch.Generator().manual_seed(0)
    for params, expected in [
        (SamplingParams(temperature=1.0), torch.softmax(logits, -1)),
        (SamplingParams(temperature=0.5), torch.softmax(logits / 0.5, -1)),
        (SamplingParams(temperature=2.0), torch.softmax(logits / 2.0, -1)),
        (SamplingParams(temperature=2.0, min_p=0.3), torch.softmax(torch.tensor([1.0, 0.5, 0.25, -1e9, -1e9]), -1)),
        (SamplingParams(temperature=1.0, top_k=2), torch.softmax(torch.tensor([2.0, 1.0, -1e9, -1e9, -1e9]), -1)),
        (SamplingParams(temperature=1.0, top_p=0.85), torch.softmax(torch.tensor([2.0, 1.0, 0.5, -1e9, -1e9]), -1)),
    ]:
        batch = logits.expand(rows, -1)
        tokens, logprobs = sample_next_tokens(batch, [params] * rows, [[]] * rows, [None] * rows, generator)
        frequencies = torch.bincount(tokens, minlength=5) / rows
        torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)
        # The distribution at the row's temperature, before top-k/top-p/min-p (as SGLang reports it).
        torch.testing.assert_close(logprobs, torch.log_softmax(logits / params.temperature, -1)[tokens])


def sample_frequencies(logits, params, rows=20000, chunk=4000, seed=0) -> torch.Tensor:
    """How often each token of one row of logits is sampled, over `rows` draws."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(rows // chunk):
        tokens, _ = sample_next_tokens(logits.expand(chunk, -1), [params] * chunk, [[]] * chunk, [None] * chunk,
                                       generator)
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts / rows


def test_low_temperatures_sample_the_dominant_token():
    # A flat row over a large vocabulary: every probability is small, so any power 1 / T of them
    # would underflow in float32 at these temperatures.
    vocab = 5000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 0.3
    top = 1234
    logits[top] = logits.max() + 1.5  # the others are e^(-1.5 / T) as likely at temperature T, or less
    rows = 64
    for temperature in [0.05, 1e-3, 1e-5, 1e-7]:
        tokens, logprobs = sample_next_tokens(
            logits.expand(rows, -1), [SamplingParams(temperature=temperature)] * rows, [[]] * rows, [None] * rows,
            torch.Generator().manual_seed(1),
        )
        assert tokens.tolist() == [top] * rows, temperature
        scale = temperature if temperature >= 1e-6 else 1.0  # below SGLang's epsilon: greedy, temperature 1's
        torch.testing.assert_close(logprobs, torch.log_softmax(logits.double() / scale, -1)[tokens].float())


def test_a_banned_likely_token_counts_in_the_logprob_and_is_never_sampled():
    """min_new_tokens bans the stop token, here the likeliest by far: the others are sampled at T = 0.3, and
    their log-probabilities are of the whole distribution at T = 0.3, the banned token included (the
    trainer's), though its power (p / peak) ** (1 / T) over the allowed peak is past float32's range."""
    logits = torch.tensor([0.0, -0.5, -1.0, -8.0, 30.0])
    rows, temperature = 4000, 0.3
    tokens, logprobs = sample_next_tokens(logits.expand(rows, -1), [SamplingParams(temperature=temperature)] * rows,
                                          [[4]] * rows, [None] * rows, torch.Generator().manual_seed(0))
    assert 4 not in tokens.tolist()
    allowed = torch.softmax(logits[:4].double() / temperature, -1)
    torch.testing.assert_close((torch.bincount(tokens, minlength=5)[:4] / rows).double(), allowed, atol=0.03, rtol=0)
    torch.testing.assert_close(logprobs.double(), torch.log_softmax(logits.double() / temperature, -1)[tokens],
                               atol=1e-4, rtol=0)


def test_a_low_temperature_samples_softmax_of_the_scaled_logits():
    # Five likely tokens over a background that holds most of the mass at temperature 1 (each
    # probability under 0.002), and next to none at T = 0.05.
    logits = torch.full((5000,), -2.0)
    logits[[10, 20, 30, 40, 50]] = torch.tensor([0.0, -0.05, -0.1, -0.15, -0.2])
    temperature = 0.05
    expected = torch.softmax(logits.double() / temperature, -1)
    frequencies = sample_frequencies(logits, SamplingParams(temperature=temperature))
    top = [10, 20, 30, 40, 50]
    torch.testing.assert_close(frequencies[top].double(), expected[top], atol=0.015, rtol=0)
    assert abs(frequencies.sum() - frequencies[top].sum()) <= 0.015


def test_temperatures_below_sglangs_epsilon_are_greedy():
    # Two tokens tie for the top: greedy takes the first, sampling either, at any temperature.
    logits = torch.zeros(100)
    logits[[3, 7]] = 2.0
    rows = 64

    def sample(temperature):
        params = [SamplingParams(temperature=temperature)] * rows
        return sample_next_tokens(logits.expand(rows, -1), params, [[]] * rows, [None] * rows,
                                  torch.Generator().manual_seed(0))[0]

    assert sample(1e-7).tolist() == [3] * rows  # SGLang: below 1e-6, top_k = 1
    assert set(sample(1e-5).tolist()) == {3, 7}


def test_a_tiny_temperature_through_the_engine_gives_greedy_tokens_and_raw_logprobs(engine, model):
    result = generate(engine, payload(PROMPTS[0], temperature=1e-7))[0]
    assert result["output_ids"] == hf_greedy(model, PROMPTS[0], 12)
    raw = torch.log_softmax(full_logits(model, PROMPTS[0], result["output_ids"]), -1)
    expected = raw.gather(1, torch.tensor(result["output_ids"])[:, None])[:, 0]
    logprobs = torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)


# Probabilities [0.4, 0.3, 0.2, 0.1]; the expected distributions are worked out by hand.
@pytest.mark.parametrize(
    "sampling, expected",
    [
        # Joint: token 1 stays, as the tokens before it hold 0.4 <= top_p; then [0.4, 0.3] / 0.7.
        (dict(top_k=2, top_p=0.5), [4 / 7, 3 / 7, 0, 0]),
        # Temperature first: [0.16, 0.09, 0.04, 0.01] / 0.3; token 1 stays (0.533 <= 0.55).
        (dict(temperature=0.5, top_k=2, top_p=0.55), [0.64, 0.36, 0, 0]),
        # With min-p: top-k renormalised to [4/7, 3/7], then top-p drops token 1 (4/7 > 0.5).
        (dict(top_k=2, top_p=0.5, min_p=0.1), [1.0, 0, 0, 0]),
        # With min-p: top-k [4/9, 3/9, 2/9], top-p 0.8 keeps them (7/9 <= 0.8), min-p drops 2/9 < 0.6 * 4/9.
        (dict(top_k=3, top_p=0.8, min_p=0.6), [4 / 7, 3 / 7, 0, 0]),
    ],
)
def test_top_k_top_p_and_min_p_combine_as_in_sglang(sampling, expected):
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    frequencies = sample_frequencies(logits, SamplingParams(**sampling))
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.015, rtol=0)


def test_sampling_seed_is_independent_of_the_batch(engine):
    seeded = payload(PROMPTS[2], temperature=1.0, max_new_tokens=10, sampling_seed=7)
    alone = generate(engine, seeded)[0]["output_ids"]
    others = [payload(p, temperature=1.0, max_new_tokens=10) for p in PROMPTS]
    batched = generate(engine, *others, seeded)[-1]["output_ids"]
    assert batched == alone


def test_pause_abort_and_continue(engine):
    long = [payload(p, max_new_tokens=300) for p in PROMPTS]

    async def main():
        running = [asyncio.create_task(engine.generate(p)) for p in long]
        while max(engine.running_lengths, default=0) < 3:
            await asyncio.sleep(0.01)
        await engine.pause_generation(mode="abort")
        aborted = await asyncio.gather(*running)

        queued = [asyncio.create_task(engine.generate(payload(p, max_new_tokens=5))) for p in PROMPTS[:2]]
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in queued)
        await engine.continue_generation()
        return aborted, await asyncio.gather(*queued)

    aborted, resumed = asyncio.run(main())
    for result in aborted:
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(result["output_ids"]) < 300
        assert len(result["meta_info"]["output_token_logprobs"]) == len(result["output_ids"])
    assert any(result["output_ids"] for result in aborted)
    assert [r["meta_info"]["finish_reason"]["type"] for r in resumed] == ["length", "length"]


def test_pause_retract_resumes_the_same_output(engine):
    request = payload(PROMPTS[2], max_new_tokens=40)
    uninterrupted = generate(engine, request)[0]["output_ids"]

    async def main():
        task = asyncio.create_task(engine.generate(request))
        while max(engine.running_lengths, default=0) < 5:
            await asyncio.sleep(0.005)
        await engine.pause_generation(mode="retract")
        await asyncio.sleep(0.05)
        assert not task.done()
        await engine.continue_generation()
        return await task

    assert asyncio.run(main())["output_ids"] == uninterrupted


def test_update_weights_switches_the_model(tokenizer, model):
    other = tiny_llama(len(tokenizer), seed=1)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    try:
        before = generate(engine, payload(PROMPTS[0]))[0]
        engine.update_weights(other.state_dict().items(), weight_version="v1")
        after = generate(engine, *(payload(p) for p in PROMPTS))
    finally:
        engine.shutdown()
    assert before["output_ids"] == hf_greedy(model, PROMPTS[0], 12)
    assert [r["output_ids"] for r in after] == [hf_greedy(other, p, 12) for p in PROMPTS]
    assert after[0]["meta_info"]["weight_version"] == "v1"


def test_the_cache_holds_the_requests_without_doubling_past_them(tokenizer, model):
    """Five short requests need 5 rows of at most 128 positions (the least the cache allocates): rows
    grow to the requests given at once, and growing them does not double the positions too. Their
    shared prefix is forwarded into one row first, so the rows grow twice."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    try:
        prompts = [PROMPTS[2] * 2 + [i] for i in range(5)]
        outputs = generate(engine, *(payload(p) for p in prompts))
        assert [o["output_ids"] for o in outputs] == [hf_greedy(model, p, 12) for p in prompts]
        shapes = {tuple(buffer.shape) for buffer in engine.runner.cache.keys + engine.runner.cache.values}
        heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
        assert shapes == {(5, heads, 128, dim)}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_released_weights_free_their_memory_and_come_back_with_a_push(tokenizer, tied):
    """On CPU the engine frees its weights between rollouts (the trainer's update needs the RAM) and
    refuses to generate until every parameter has been pushed again."""
    model = tiny_llama(len(tokenizer), seed=3, tie_word_embeddings=tied)
    new_weights = tiny_llama(len(tokenizer), seed=4, tie_word_embeddings=tied)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    try:
        assert engine.releases_memory
        before = generate(engine, payload(PROMPTS[0]))[0]
        engine.release_memory(["weights", "kv_cache"])
        assert all(p.numel() == 0 for p in engine.runner.model.parameters())
        assert engine.runner.cache.keys == []
        pushed = list(new_weights.named_parameters())  # parameters only, as a trainer pushes them
        engine.update_weights(pushed[:-1], weight_version="partial")
        with pytest.raises(RuntimeError, match=f"released and 1 were not loaded again.*{pushed[-1][0]}"):
            generate(engine, payload(PROMPTS[0]))
        engine.update_weights(pushed[-1:], weight_version="v1")
        after = generate(engine, *(payload(p) for p in PROMPTS))
        engine.release_memory(["weights"])
        engine.update_weights(model.named_parameters(), weight_version="v2")
        again = generate(engine, payload(PROMPTS[0]))[0]
    finally:
        engine.shutdown()
    assert before["output_ids"] == again["output_ids"] == hf_greedy(model, PROMPTS[0], 12)
    assert [r["output_ids"] for r in after] == [hf_greedy(new_weights, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_an_engine_that_owns_its_model_keeps_one_copy_of_the_linear_weights(tokenizer, tied):
    """With `owns_model` the panels are the only copy of the linear layers' weights: the layers' own
    parameters are empty from the start, pushed weights go straight into the panels, and the engine
    serves exactly what HF serves from the same weights."""
    config = dict(tie_word_embeddings=tied, attention_bias=True, mlp_bias=True)  # biases are packed too
    model, new_weights = tiny_llama(len(tokenizer), seed=3, **config), tiny_llama(len(tokenizer), seed=4, **config)
    for module in (model, new_weights):  # from_config zeroes biases: random ones are what a push must carry
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, owns_model=True)
    try:
        runner = engine.runner
        if runner.panel_kernels is None:
            pytest.skip("the panel kernels did not build here")
        linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
        head = runner.model.get_output_embeddings()
        for linear in linears:
            kept = tied and linear is head  # the embedding reads it too
            assert (linear.weight.numel() > 0) == kept, "only the tied output projection keeps its own copy"
        assert all(linear.bias.numel() == 0 for linear in linears if linear.bias is not None)
        expected = dict(model.state_dict())
        state = runner.state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[name], expected[name]) for name in expected), "read back from the panels"
        before = generate(engine, *(payload(p) for p in PROMPTS))

        engine.release_memory(["weights", "kv_cache"])
        pushed = list(new_weights.named_parameters())
        engine.update_weights(pushed[:-1], weight_version="partial")
        with pytest.raises(RuntimeError, match=f"released and 1 were not loaded again.*{pushed[-1][0]}"):
            generate(engine, payload(PROMPTS[0]))
        engine.update_weights(pushed[-1:], weight_version="v1")
        assert all(linear.weight.numel() == 0 for linear in linears if not (tied and linear is head))
        state, expected = runner.state_dict(), dict(new_weights.state_dict())
        assert all(torch.equal(state[name], expected[name]) for name in expected), "pushed into the panels"
        after = generate(engine, *(payload(p) for p in PROMPTS))
        name = next(n for n, _ in pushed if n.endswith("q_proj.weight"))
        with pytest.raises(ValueError, match=f"'{name}' has shape \\(3, 64\\), the engine model expects \\(64, 64\\)"):
            engine.update_weights([(name, torch.zeros(3, 64))], weight_version="bad")
    finally:
        engine.shutdown()
    assert [r["output_ids"] for r in before] == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert [r["output_ids"] for r in after] == [hf_greedy(new_weights, p, 12) for p in PROMPTS]


def test_weights_changed_in_place_are_not_served_stale(tokenizer, model):
    other = tiny_llama(len(tokenizer), seed=2)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    try:
        generate(engine, payload(PROMPTS[0]))
        with torch.no_grad():  # behind the engine's back: any packed copy of a weight is now stale
            for mine, theirs in zip(engine.runner.model.parameters(), other.parameters()):
                mine.copy_(theirs)
        after = generate(engine, payload(PROMPTS[0]))[0]
    finally:
        engine.shutdown()
    assert after["output_ids"] == hf_greedy(other, PROMPTS[0], 12)


def test_parameters_mapped_from_the_checkpoint_file_are_copied_once(tmp_path, tokenizer, model):
    """`from_pretrained` maps safetensors files privately; the engine copies those parameters into
    its own memory, so that weight updates do not copy-on-write them page by page."""
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    def file_mappings() -> list[tuple[int, int]]:  # address ranges mapped from files, as the kernel lists them
        with open("/proc/self/maps") as maps:
            fields = [line.split() for line in maps.read().splitlines()]
        return [tuple(int(a, 16) for a in f[0].split("-")) for f in fields if len(f) >= 6 and f[5].startswith("/")]

    def in_a_file_mapping(param):
        return any(start <= param.data_ptr() < end for start, end in file_mappings())

    if not any(in_a_file_mapping(p) for p in loaded.parameters()):
        pytest.skip("this transformers/safetensors build does not map checkpoint files")
    engine = EmbeddedEngine(loaded, tokenizer)
    try:
        assert not any(in_a_file_mapping(p) for p in loaded.parameters())
        output = generate(engine, payload(PROMPTS[0]))[0]["output_ids"]
    finally:
        engine.shutdown()
    for mine, original in zip(loaded.parameters(), model.parameters()):
        torch.testing.assert_close(mine, original, rtol=0, atol=0)
    assert output == hf_greedy(model, PROMPTS[0], 12)


def test_a_failing_forward_fails_every_request(tokenizer, model):
    broken = copy.deepcopy(model)

    def explode(*args, **kwargs):
        raise ValueError("boom")

    broken.model.embed_tokens.forward = explode
    engine = EmbeddedEngine(broken, tokenizer)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate(engine, *(payload(p) for p in PROMPTS))
        with pytest.raises(RuntimeError, match="boom"):
            generate(engine, payload(PROMPTS[0]))
    finally:
        engine.shutdown()


def test_invalid_requests_are_rejected(engine):
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(engine, payload(PROMPTS[0], repetition_penalty=1.2))
    with pytest.raises(ValueError, match="unknown"):
        generate(engine, payload(PROMPTS[0], tempreature=1.0))
    empty = generate(engine, payload(PROMPTS[0], max_new_tokens=0))[0]
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


def test_requests_that_could_run_past_the_context_are_refused_as_sglang_does(engine, model):
    context = model.config.max_position_embeddings
    prompt = [5] * (context - 10)
    with pytest.raises(ValueError, match=rf"\({context - 10}\) \+ max_new_tokens \(11\) "
                                         rf"exceeds the model's context length of {context}"):
        generate(engine, payload(prompt, max_new_tokens=11))
    with pytest.raises(ValueError, match="context length"):
        generate(engine, payload([5] * context, max_new_tokens=0))
    fits = generate(engine, payload(prompt, max_new_tokens=10))[0]  # exactly up to the last position
    assert len(fits["output_ids"]) == 10


def test_a_request_with_an_id_outside_the_vocabulary_fails_alone(engine, tokenizer):
    good = payload(PROMPTS[2], max_new_tokens=20)
    alone = generate(engine, good)[0]["output_ids"]
    vocab = len(tokenizer)

    async def main():
        running = asyncio.create_task(engine.generate(good))
        await asyncio.sleep(0)  # queued first
        bad = [engine.generate(payload([1, vocab], max_new_tokens=5)), engine.generate(payload([-1, 2]))]
        return await asyncio.gather(running, *bad, return_exceptions=True)

    result, too_large, negative = asyncio.run(main())
    assert (isinstance(too_large, ValueError) and f"holds {vocab}," in str(too_large)
            and f"{vocab} tokens" in str(too_large))
    assert isinstance(negative, ValueError) and "holds -1," in str(negative)
    assert result["output_ids"] == alone
    assert generate(engine, good)[0]["output_ids"] == alone
