"""A rule-based reward for the GRPO example (OpenRLHF loads ``reward_func`` from the file given
as ``--reward.remote_url``): +1 when the response ends with a boxed answer equal to the label."""

import re

import torch


def reward_func(queries, prompts, labels):
    rewards = []
    for q, label in zip(queries, labels):
        m = re.findall(r"\\boxed\{([^}]*)\}", q)
        rewards.append(1.0 if m and m[-1].strip() == str(label).strip() else 0.0)
    r = torch.tensor(rewards)
    return {"rewards": r, "scores": r, "extra_logs": {}}
