"""Run comparison reports: ``mcpo report RUN_DIR... --out DIR`` (tables per sweep axis, eval table, figures)."""
