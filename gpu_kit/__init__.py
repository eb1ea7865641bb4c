"""The GPU kit: one command that runs every check one GPU can make (``python3 gpu_kit/run.py --out DIR``);
see gpu_kit/README.md."""
