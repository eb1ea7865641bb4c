"""One process (a world of one): dist_checkpointing.save, then the scheduler's signals to every process the
rank started, then another save. Usage: ckpt_signal_worker.py OUT_DIR. Prints the helpers signalled and
"second save ok" when the second save wrote its checkpoint."""

import os
import signal
import sys
from pathlib import Path

import psutil
import torch


def main(out: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from mcpo_megatron.models.checkpoint_writer import start_checkpoint_writer
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
    from mcpo_megatron.trainer.preemption import StopRequest

    init_distributed()
    stop = StopRequest(enabled=True)  # the trainer's handlers: the rank itself survives the signals
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    for n in (1, 2):
        if n == 2:
            helpers = psutil.Process().children(recursive=True)
            print(f"signalling {len(helpers)} helper(s)", flush=True)
            for pid in [p.pid for p in helpers] + [os.getpid()]:  # every process of the step, the rank too
                for sig in (signal.SIGUSR1, signal.SIGTERM):
                    os.kill(pid, sig)
            psutil.wait_procs(helpers, timeout=1.0)
        (out / f"ckpt{n}").mkdir()
        start_checkpoint_writer()  # what MegatronPolicy.save_checkpoint does before every save
        dist_checkpointing.save(state, str(out / f"ckpt{n}"))
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(out / "ckpt2"))
    assert torch.equal(loaded["w"], torch.arange(8.0)), loaded
    print(f"second save ok; signal seen by the rank: {stop.signal_name}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
