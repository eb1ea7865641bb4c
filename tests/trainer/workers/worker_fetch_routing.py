"""Worker (run under torchrun, 4 ranks): R3 routing kept where it was generated, then fetched per DP share.

Two rollout replicas of TP=2 (ranks 0-1 and 2-3) run a stand-in engine whose routing of sample s of prompt p is
filled with the value 1000 p + s (so a misplaced record is visible); generate_data_parallel(keep_routing_local=True)
must leave each rank only its replica's routing; fetch_routing must then give each rank exactly the samples it is
asked for. Writes OUT/rank{R}.json.
"""

import json
import sys
from pathlib import Path

import torch

from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
from mcpo_megatron.rollout.engines.interface import RolloutEngine, RolloutOutput, RolloutSample, SamplingParams
from mcpo_megatron.rollout.engines.interface import generate_data_parallel
from mcpo_megatron.trainer.step_data import Rollouts, fetch_routing

LAYERS, TOPK = 3, 2


class RoutingEngine(RolloutEngine):
    """Responses of p + s + 1 tokens; routing [prompt + response - 1, LAYERS, TOPK] filled with 1000 p + s."""

    def generate(self, prompts_token_ids, sampling, *, prompt_indices=None, should_stop=None):
        indices = list(prompt_indices if prompt_indices is not None else range(len(prompts_token_ids)))
        out = []
        for p, prompt in zip(indices, prompts_token_ids):
            for s in range(sampling.n):
                n = p + s + 1
                routes = torch.full((len(prompt) + n - 1, LAYERS, TOPK), 1000 * p + s, dtype=torch.int16)
                out.append(RolloutSample(p, s, [7] * n, [-0.5] * n, "length", routed_experts=routes))
        return RolloutOutput(out)

    def update_weights(self, named_tensors):  # pragma: no cover - not used
        raise NotImplementedError

    def sleep(self):  # pragma: no cover - not used
        pass

    def wake_up(self):  # pragma: no cover - not used
        pass


def main() -> None:
    out_dir = Path(sys.argv[1])
    info = init_distributed(1, 1, seed=0)
    prompts = [[1, 2, 3]] * 5
    n = 2
    out = generate_data_parallel(RoutingEngine(), prompts, SamplingParams(n=n, max_new_tokens=8), rollout_tp=2,
                                 keep_routing_local=True)
    held_after_generation = [i for i, x in enumerate(out.routed_experts) if x is not None]
    r = Rollouts(group_size=n, uids=[str(p) for p in range(5)], prompt_ids=prompts,
                 response_ids=out.token_ids, rollout_logp=out.logprobs, finish_reasons=out.finish_reasons,
                 scores=torch.zeros(10, dtype=torch.float64), correct=torch.zeros(10, dtype=torch.float64),
                 statuses=["ok"] * 10, gcpo_injected=torch.zeros(10, dtype=torch.bool),
                 routed_experts=out.routed_experts, routing_ranks=out.routing_ranks)
    # dynamic sampling keeps groups 4, 1, 3 (in that order); each rank asks for a different set
    r = r.select_groups([4, 1, 3])
    needed = {0: [0, 5], 1: [1, 2, 3], 2: [], 3: [0, 1, 2, 3, 4, 5]}[info.rank]
    fetch_routing(r, needed, info.rank, chunk=2)  # several broadcasts per holder
    got = {str(i): None if x is None else [int(x.min()), int(x.max()), list(x.shape)]
           for i, x in enumerate(r.routed_experts)}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps({
        "routing_ranks": out.routing_ranks, "held_after_generation": held_after_generation, "got": got}))
    destroy_distributed()


if __name__ == "__main__":
    main()
