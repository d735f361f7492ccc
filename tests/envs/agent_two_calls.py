"""Test agent script: two chat calls through the openai client (the second sends back the first answer and
asks again), reward 1 when the second answer has an odd number of characters, so that runs of one prompt differ."""


async def run(client, extra_info: dict) -> dict:
    messages = list(extra_info["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    reward = float(len(second.choices[0].message.content) % 2)
    return {"reward": reward, "score": reward, "reward_parts": {"odd": reward}}
