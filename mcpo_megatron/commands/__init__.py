"""The ``mcpo`` subcommands (``mcpo_megatron/cli.py`` dispatches): the top layer, on top of the training loop
(:mod:`mcpo_megatron.trainer`) and the building blocks. One module per command, each with ``add_parser`` and
``run``; none runs as a script of its own."""
