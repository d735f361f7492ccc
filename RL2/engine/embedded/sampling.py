"""Sampling parameters, batched next-token sampling and stop rules of the embedded engine, as SGLang's `/generate` has
them: the parameter names and defaults of `sglang.srt.sampling.sampling_params.SamplingParams`, the finish rules of
`Req.check_finished` (schedule_batch.py) and the text trimming of `DetokenizerManager.trim_matched_stop`."""

from dataclasses import dataclass, field

import torch

from RL2.config.ppo_schema import GREEDY_TEMPERATURE
from RL2.native.build import SUFFIXES
from RL2.native.decode_kernels import DecodeKernels

# Keys SGLang accepts that change nothing here as long as they keep their default value.
_NEUTRAL_DEFAULTS = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None,
    "spaces_between_special_tokens": True, "stream_interval": None,
}


@dataclass
class SamplingParams:
    """One request's sampling parameters, with SGLang's names and defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    # Longest stop string in tokens: how many trailing tokens to decode when looking for one.
    stop_max_tokens: int = 0

    @classmethod
    def from_dict(cls, params: dict | None, tokenizer) -> "SamplingParams":
        """Validate the `sampling_params` of a `/generate` payload (None: all defaults); `tokenizer` measures
        stop strings in tokens."""
        params = dict(params or {})
        for key, default in _NEUTRAL_DEFAULTS.items():
            value = params.pop(key, default)
            if value != default:
                raise ValueError(f"sampling param {key}={value!r} is not supported by the embedded engine; "
                                 f"drop it or run SGLang")
        known = set(cls.__dataclass_fields__) - {"stop_max_tokens"}
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown sampling params {sorted(unknown)}; known: {sorted(known)}")
        stop = params.pop("stop", None) or []
        sp = cls(**{k: v for k, v in params.items() if v is not None})
        sp.stop = [stop] if isinstance(stop, str) else list(stop)
        sp.stop_token_ids = list(sp.stop_token_ids or [])
        sp.top_k = sp.top_k if sp.top_k > 0 else -1
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.max_new_tokens < 0:
            raise ValueError(f"invalid sampling params: {sp}")
        sp.stop_max_tokens = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in sp.stop), default=0)
        return sp

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams], banned: list[list[int]],
                       generators: list[torch.Generator | None], default_generator: torch.Generator | None = None,
                       kernels: DecodeKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs): one token per row of `logits`, all rows at once, in float32. Row r never samples `banned[r]`
    (stop tokens before min_new_tokens) and draws from `generators[r]` (a request's sampling_seed) or, if None, from
    `default_generator` (None: torch's global one). The log-probability is the token's under softmax(logits / T), before
    filters and bans, as SGLang returns it (docs/gpus.md, "Log-probabilities"); greedy rows give temperature 1's.
    With the C `kernels`, a batch that only samples (no greedy row, filter or ban: RL's usual rollout) is drawn there,
    the same draw in two passes over the logits instead of the torch ops' five."""
    device = logits.device
    if (kernels is not None and device.type == "cpu" and logits.dtype in SUFFIXES and not any(banned)
            and all(map(_only_samples, params))):
        temperatures = torch.tensor([p.temperature for p in params])
        return kernels.sample_rows(logits, temperatures, _uniforms(generators, default_generator))
    # The policy's own probabilities, in one fused pass; every filter below works on them (a temperature as a power).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    allowed = probs
    if any(banned):
        index = (torch.tensor([r for r, ids in enumerate(banned) for _ in ids], device=device),
                 torch.tensor([t for ids in banned for t in ids], device=device))
        allowed = probs.index_put(index, torch.tensor(0.0, device=device))
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    everything = len(sampled) == len(params)
    tokens = torch.empty(len(params), dtype=torch.long, device=device) if everything else allowed.argmax(dim=-1)
    tempered = None
    if sampled:
        rows = torch.tensor(sampled, device=device)
        sampled_params = [params[r] for r in sampled]
        tempered = _Tempered.of(allowed if everything else allowed[rows], sampled_params)
        if tempered.scaled and any(banned[r] for r in sampled):
            tempered.add_banned(probs if everything else probs[rows], [banned[r] for r in sampled])
        weights = _sampling_weights(tempered.weights, sampled_params)
        # Inverse-CDF sampling: one uniform number per row, so a seeded request draws from its own generator inside any
        # batch, and no per-token noise is needed (costlier than the rest). CPU cumsum accumulates in float64.
        cdf = weights.cumsum(dim=-1)
        uniform = _uniforms([generators[r] for r in sampled], default_generator)
        picked = torch.searchsorted(cdf, (uniform.to(device) * cdf[:, -1])[:, None], right=True)
        tokens[rows] = picked[:, 0].clamp_max(logits.shape[-1] - 1)
    logprobs = probs.gather(1, tokens[:, None])[:, 0].log()
    if tempered is not None and tempered.scaled:
        logprobs[rows] = tempered.logprobs(logprobs[rows])
    return tokens, logprobs


def _uniforms(generators: list[torch.Generator | None], default_generator: torch.Generator | None) -> torch.Tensor:
    """One uniform number per sampled row, from its request's generator where it has one."""
    uniform = torch.rand(len(generators), generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(1, generator=generator)
    return uniform


def _only_samples(params: SamplingParams) -> bool:
    """Whether a row's draw is from softmax(logits / T) as it is: not greedy, no top-k, top-p or min-p."""
    return not params.greedy and params.top_k <= 0 and params.top_p >= 1 and params.min_p <= 0


@dataclass
class _Tempered:
    """softmax(logits / T) of each row, unnormalised, as softmax(logits) ** (1 / T). Each row is divided by its largest
    (allowed) probability first, so that its top token keeps weight 1: at a low temperature the powers of the
    probabilities themselves all underflow to 0 in float32. Rows at T = 1 are divided by 1: left exactly as they are."""

    weights: torch.Tensor  # [rows, vocab] (p / peak) ** (1 / T), banned tokens at 0
    temperature: torch.Tensor  # [rows]
    log_peak: torch.Tensor | None = None  # [rows] log of the largest allowed probability (0 at T = 1)
    # [rows] log of the sum of (p / peak) ** (1 / T) over the whole vocabulary, banned tokens included
    # (`add_banned`): log softmax(logits / T) at token y is (log p_y - log_peak) / T - log_sum.
    log_sum: torch.Tensor | None = None

    @property
    def scaled(self) -> bool:
        """Whether any row has T != 1 (else `weights` are the probabilities themselves)."""
        return self.log_sum is not None

    @classmethod
    def of(cls, probs: torch.Tensor, params: list[SamplingParams]) -> "_Tempered":
        temperature = torch.tensor([p.temperature for p in params], device=probs.device)
        if (temperature == 1).all():
            return cls(probs, temperature)
        peak = torch.where(temperature[:, None] == 1, 1.0, probs.amax(dim=-1, keepdim=True))
        weights = (probs / peak).pow((1 / temperature)[:, None])
        return cls(weights, temperature, peak[:, 0].log(), weights.sum(dim=-1).log())

    def add_banned(self, probs: torch.Tensor, banned: list[list[int]]) -> None:
        """Count the banned tokens (0 in `weights`) into `log_sum`, in logs: a banned token may be far
        likelier than the allowed peak. `probs` are the rows' probabilities at T = 1 before the bans."""
        for row, ids in enumerate(banned):
            if ids:
                scaled = (probs[row, ids].log() - self.log_peak[row]) / self.temperature[row]
                self.log_sum[row] = torch.logaddexp(self.log_sum[row], scaled.logsumexp(0))

    def logprobs(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Log-probabilities at T = 1 of one token per row -> at each row's temperature."""
        at_temperature = (logprobs - self.log_peak) / self.temperature - self.log_sum
        return torch.where(self.temperature == 1, logprobs, at_temperature)


def _sampling_weights(weights: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalised sampling probabilities, filtered the way SGLang's sampler does. `weights` are already at each row's
    temperature (`_Tempered`; banned tokens at 0). For a row without min-p, top-k and top-p together on them: a token
    stays if it is among the top_k and the tokens likelier than it hold at most top_p of the probability (flashinfer's
    `top_k_top_p_sampling_from_probs` with `filter_apply_order="joint"`). For a row with min-p: top-k, then top-p on
    the renormalised top-k tokens, then min-p (`top_k_renorm_prob`, `top_p_renorm_prob`, `min_p_sampling_from_probs`).
    SGLang picks one of the two for the whole batch (min-p if any request has it); here each row follows its own
    parameters, so that a request samples alike in any batch."""
    device = weights.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    drop = None  # tokens top-k and top-p filter out
    if top_k.any():
        k_max = min(int(top_k.max()), weights.shape[-1])
        kth = weights.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        kth[top_k == 0] = 0.0
        drop = weights < kth
    if (top_p < 1).any():
        # Jointly, top-p measures the tokens' mass in the whole distribution; after top-k (min-p rows), in those kept.
        measured = weights
        if drop is not None and (min_p > 0).any():
            measured = torch.where((min_p > 0)[:, None], weights.masked_fill(drop, 0.0), weights)
        normalized = measured / measured.sum(dim=-1, keepdim=True)
        sorted_probs, order = normalized.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already cover top_p; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop_p = drop_sorted.scatter(1, order, drop_sorted)
        drop = drop_p if drop is None else drop | drop_p
    if drop is not None:
        weights = weights.masked_fill(drop, 0.0)
    if (min_p > 0).any():
        weights = weights.masked_fill(weights < min_p[:, None] * weights.amax(dim=-1, keepdim=True), 0.0)
    return weights


def finish_reason(output_ids: list[int], params: SamplingParams, eos_ids: set[int], tokenizer) -> dict | None:
    """Why a request stops after its newest token (`output_ids`: those generated so far), or None: as in SGLang, length
    first, then stop tokens, then stop strings, and `ignore_eos` also switches off `stop_token_ids`."""
    if len(output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    last = output_ids[-1]
    if not params.ignore_eos and (last in eos_ids or last in params.stop_token_ids):
        return {"type": "stop", "matched": last}
    if params.stop:
        # A stop string that appears now ends in the newest token, so the tail decode is enough.
        tail = tokenizer.decode(output_ids[-(params.stop_max_tokens + 1) :])
        for stop in params.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    return None


def stop_tokens_to_ban(num_output: int, params: SamplingParams, eos_ids: set[int]) -> list[int]:
    """Tokens the sampler must avoid so that a request reaches min_new_tokens (SGLang's MinNewTokensPenalizer)."""
    if num_output >= params.min_new_tokens:
        return []
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids))


def output_text(output_ids: list[int], reason: dict | None, params: SamplingParams, tokenizer) -> str:
    """Decode the output as SGLang's detokenizer does: a matched stop token left out, a matched stop string cut with
    what follows (with no_stop_trim the stop stays in); `output_ids` always keep every sampled token."""
    matched = (reason or {}).get("matched")
    ids = output_ids
    if isinstance(matched, int) and not params.no_stop_trim:
        ids = output_ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
    return text
