"""The Table-1 style Markdown table and the JSON round trip, on fixed results."""

from mcpo_megatron.evaluation import (
    BenchmarkResult,
    format_score,
    markdown_table,
    read_results,
    write_results,
)


def _res(name, p1, pk, boot, k=8):
    return BenchmarkResult(
        name=name, num_problems=30, samples_per_problem=8, k=k, pass_at_1=p1, pass_at_k=pk,
        bootstrap_pass_at_k=boot, mean_response_length=1234.5, length_unit="tokens", truncation_rate=0.01,
        status_counts={"ok": 230, "no_answer": 10, "timeout": 0, "crashed": 0},
    )


RESULTS = {
    "8B DAPO": {"aime_2024": _res("aime_2024", 0.4, 0.7, 0.6483), "aime_2025": _res("aime_2025", 0.3083, 0.5, 0.4824),
                "amc_2023": _res("amc_2023", 0.84375, 0.99, 0.9706)},
    "8B MCPO": {"aime_2024": _res("aime_2024", 0.4458, 0.75, 0.7012), "amc_2023": _res("amc_2023", 1.0, 1.0, 1.0)},
}


def test_format_score_like_the_paper():
    assert format_score(0.4) == ".4000"
    assert format_score(0.64834) == ".6483"
    assert format_score(1.0) == "1.0000"
    assert format_score(float("nan")) == "n/a"


def test_markdown_table_layout():
    expected = (
        "| | AIME24 | AIME25 | AMC23 |\n"
        "|---|---|---|---|\n"
        "| 8B DAPO | .4000/.6483 | .3083/.4824 | .8438/.9706 |\n"
        "| 8B MCPO | .4458/.7012 | – | 1.0000/1.0000 |\n"
    )
    assert markdown_table(RESULTS, caption=False) == expected
    unbiased = markdown_table(RESULTS, estimator="unbiased", caption=False)
    assert "| 8B DAPO | .4000/.7000 | .3083/.5000 | .8438/.9900 |" in unbiased
    with_caption = markdown_table(RESULTS)
    assert with_caption.startswith("pass@1 / pass@8 (bootstrap best@k")
    assert with_caption.endswith(expected)
    only = markdown_table(RESULTS, benchmarks=["amc_2023"], caption=False)
    assert only.splitlines()[0] == "| | AMC23 |"


def test_json_and_markdown_files_round_trip(tmp_path):
    paths = write_results(RESULTS, tmp_path)
    assert read_results(paths["json"]) == {run: dict(v) for run, v in RESULTS.items()}
    md = paths["markdown"].read_text()
    assert "| 8B MCPO | .4458/.7012 | – | 1.0000/1.0000 |" in md  # bootstrap table
    assert "| 8B MCPO | .4458/.7500 | – | 1.0000/1.0000 |" in md  # unbiased table
