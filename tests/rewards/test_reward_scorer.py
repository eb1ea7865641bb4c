"""MathVerifyScorer: a table of correct/incorrect pairs, adversarial inputs, deadlines, threads.

The expected labels in the tables are written by hand (mathematical truth), not produced by the
code under test. Timeouts are small so the module stays fast.
"""

import os
import subprocess
import sys
import signal
import threading
import time

import pytest

from mcpo_megatron.rewards import Grading, MathVerifyScorer, RewardResult, status_counts

TIMEOUT_S = 2.0
# Correctness tables are not about deadlines: a generous one keeps them stable on a loaded machine.
TABLE_TIMEOUT_S = 60.0
# A killed worker is replaced by a fresh spawn (~1 s to import math-verify on this machine);
# the next item waits for it, so allow that on top of the deadline.
RESPAWN_SLACK_S = 8.0

# (response, gold, expected correct)
DAPO_TABLE = [
    ("Step 1: 6*7 = 42.\nAnswer: 42", "42", 1),
    ("Step 1: 6*7 = 41.\nAnswer: 41", "42", 0),
    ("Answer: -7", "-7", 1),
    ("Answer: 7", "-7", 0),
    # fractions
    ("Answer: \\frac{3}{4}", "\\frac{3}{4}", 1),
    ("Answer: 0.75", "\\frac{3}{4}", 1),
    ("Answer: 3/4", "0.75", 1),
    ("Answer: 0.5", "\\frac{1}{3}", 0),
    # decimals
    ("Answer: 3.14", "3.14", 1),
    ("Answer: 3.1416", "3.14", 0),
    ("Answer: 27.0", "27", 1),
    # sets (LaTeX on the Answer line is read inside $...$)
    ("Answer: $\\{1, 2, 3\\}$", "\\{3, 2, 1\\}", 1),
    ("Answer: $\\{1, 2\\}$", "\\{1, 2, 3\\}", 0),
    # intervals
    ("Answer: $(1, 2]$", "(1, 2]", 1),
    ("Answer: $[1, 2]$", "(1, 2]", 0),
    ("Answer: $(-\\infty, 3)$", "(-\\infty, 3)", 1),
    # radicals and polynomials
    ("Answer: $2\\sqrt{2}$", "\\sqrt{8}", 1),
    ("Answer: $2\\sqrt{3}$", "\\sqrt{8}", 0),
    ("Answer: $x^2+2x+1$", "(x+1)^2", 1),
    # \boxed{} without an Answer line (math-verify's extraction, boxes first); an Answer line wins over a box
    ("so the result is \\boxed{12}.", "12", 1),
    ("so the result is \\boxed{13}.", "12", 0),
    ("\\boxed{5}\nAnswer: 6", "6", 1),
    ("\\boxed{5}\nAnswer: 6", "5", 0),
    # the last Answer line wins
    ("Answer: 3\nWait, let me recheck.\nAnswer: 4", "4", 1),
    ("Answer: 3\nWait, let me recheck.\nAnswer: 4", "3", 0),
    # only the last 1,000 characters are read
    ("Answer: 5\n" + "more text " * 200, "5", 0),
    ("filler " * 2000 + "\nAnswer: 5", "5", 1),
]

BOXED_TABLE = [
    ("We get \\boxed{\\frac{1}{2}}.", "0.5", 1),
    ("We get \\boxed{\\frac{1}{\\sqrt{4}}}.", "\\frac{1}{2}", 1),
    ("We get \\boxed{\\frac{1}{3}}.", "0.5", 0),
    ("\\boxed{1} first, finally \\boxed{2}", "2", 1),
]

LAST_NUMBER_TABLE = [
    ("7 + 5 is 12.", "12", 1),
    ("It is 12, not 13", "12", 0),
    ("The result: -3", "-3", 1),
    ("1,234 apples", "1234", 1),
    ("that is 3/4", "0.75", 1),
    ("The answer is 12.5 dollars", "25/2", 1),
]

NORMAL = ("Reasoning.\nAnswer: 7", "7")

ADVERSARIAL = {
    "tower_boxed": "So the answer is \\boxed{9^{9^{9^9}}}",
    "tower_answer_line": "Answer: $5^{5^{5^5}}$",
    "power_of_power": "\\boxed{(2^{99999})^{99999}}",
    # sympy works on these for minutes in pure Python/C: the worker must be killed
    "symbolic_expansion": "\\boxed{(x+1)^{3000}}",
    "trig_simplify": "\\boxed{\\sin(x)^{300}+\\cos(x)^{300}}",
    "huge_tan": "\\boxed{\\tan(10^{99999})}",
    "huge_product": "\\boxed{\\prod_{k=1}^{10^{8}} k}",
    "huge_binomial": "\\boxed{\\binom{10^{9}}{10^{8}}}",
    "nested_parens_3000": "Answer: " + "(" * 3000 + "1" + ")" * 3000,
    "nested_parens_3000_boxed": "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "long_100k": "x" * 100_000 + "\nAnswer: 8",
    "frac_repeated": "Answer: " + "\\frac{1}{" * 2000,
    "frac_repeated_boxed": "\\boxed{" + "\\frac{1}{" * 2000 + "}" * 2000,
    "binary_garbage": bytes(range(256)).decode("latin-1") * 400,
    "empty": "",
    "whitespace": " \n\t ",
    "nul_bytes": "\x00" * 5000,
}
HANG = ADVERSARIAL["symbolic_expansion"]


@pytest.fixture(scope="module")
def scorer():
    with MathVerifyScorer(num_workers=2, timeout_s=TIMEOUT_S, memory_mb=2048) as s:
        s.wait_ready()
        yield s


def _labels(results):
    return [r.correct for r in results]


@pytest.mark.parametrize(
    "table,fmt", [(DAPO_TABLE, "dapo"), (BOXED_TABLE, "boxed"), (LAST_NUMBER_TABLE, "last_number")]
)
def test_table_of_correct_and_incorrect_pairs(table, fmt):
    with MathVerifyScorer(num_workers=2, timeout_s=TABLE_TIMEOUT_S, grading=Grading(fmt)) as s:
        results = s.score([r for r, _, _ in table], [g for _, g, _ in table])
    wrong = [(r[:60], g, want, res) for (r, g, want), res in zip(table, results) if res.correct != want]
    assert not wrong, f"mislabelled pairs: {wrong}"
    for (_, _, want), res in zip(table, results):
        assert res.score == (1.0 if want else -1.0)
        assert res.status == "ok" if want else res.status in ("ok", "no_answer")


def test_no_answer_status(scorer):
    with MathVerifyScorer(num_workers=1, timeout_s=TIMEOUT_S, grading=Grading("boxed")) as s:
        res = s.score(["Answer: 5 (no box)"], ["5"])
    assert res[0].status == "no_answer" and res[0].correct == 0 and res[0].score == -1.0
    assert res[0].extracted is None
    res = scorer.score([""], ["5"])
    assert res[0].status == "no_answer"


def test_adversarial_items_finish_within_deadline_score_zero_and_leave_pool_healthy(scorer):
    worst = 0.0
    statuses = {}
    for name, text in ADVERSARIAL.items():
        t0 = time.monotonic()
        res = scorer.score([text], ["1"])[0]
        wall = time.monotonic() - t0
        worst = max(worst, wall)
        assert wall <= TIMEOUT_S + RESPAWN_SLACK_S, f"{name} took {wall:.1f} s"
        assert res.correct == 0 and res.score == -1.0, f"{name}: {res}"
        assert res.status in ("ok", "no_answer", "timeout", "crashed")
        statuses[name] = res.status
        # the pool is healthy: a normal item scores right afterwards
        ok = scorer.score([NORMAL[0]], [NORMAL[1]])[0]
        assert ok.correct == 1 and ok.status == "ok", f"after {name}: {ok}"
    print(f"worst adversarial wall time: {worst:.2f} s (timeout_s={TIMEOUT_S}); statuses {statuses}")
    assert statuses["symbolic_expansion"] == "timeout"  # a real hang: the worker was killed


def test_killed_items_report_timeout_and_a_batch_keeps_its_other_items(scorer):
    before = scorer.counters["respawns"]
    responses = ["Answer: 1", HANG, "Answer: 2", ADVERSARIAL["trig_simplify"], "Answer: 3"]
    golds = ["1", "1", "2", "1", "4"]
    t0 = time.monotonic()
    res = scorer.score(responses, golds)
    wall = time.monotonic() - t0
    assert _labels(res) == [1, 0, 1, 0, 0]
    assert [r.status for r in res] == ["ok", "timeout", "ok", "timeout", "ok"]
    assert scorer.counters["respawns"] - before == 2
    # both hanging items ran in parallel on two workers, each bounded by its own deadline
    assert wall <= 2 * TIMEOUT_S + RESPAWN_SLACK_S
    assert status_counts(res) == {"ok": 3, "no_answer": 0, "timeout": 2, "crashed": 0}


def test_score_from_a_non_main_thread(scorer):
    out = {}

    def work():
        try:
            out["res"] = scorer.score(
                ["Answer: \\frac{1}{2}", HANG, "Answer: 0.5"], ["1/2", "1", "1/2"]
            )
        except BaseException as e:  # noqa: BLE001  surface the error in the main thread
            out["err"] = e

    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive()
    assert "err" not in out, out.get("err")
    assert _labels(out["res"]) == [1, 0, 1]
    assert out["res"][1].status == "timeout"


def test_concurrent_callers_get_their_own_results(scorer):
    outs = {}

    def work(k):
        outs[k] = scorer.score([f"Answer: {k}", f"Answer: {k + 1}"], [str(k), str(k)])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert {k: _labels(v) for k, v in outs.items()} == {k: [1, 0] for k in range(4)}


def test_worker_death_scores_crashed_and_pool_recovers():
    with MathVerifyScorer(num_workers=1, timeout_s=30.0) as s:
        s.wait_ready()
        pid = s._workers[0].proc.pid

        def kill_soon():
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        t0 = time.monotonic()
        res = s.score([HANG, "Answer: 2"], ["1", "2"])
        killer.join()
        assert time.monotonic() - t0 < 20  # well before the 30 s deadline
        assert [r.status for r in res] == ["crashed", "ok"]
        assert _labels(res) == [0, 1]
        assert s.counters["crashed"] == 1 and s.counters["respawns"] == 1


def test_scheduler_signals_do_not_reach_the_verdicts():
    """SLURM delivers a preemption USR1 or the time limit's TERM (and a terminal its Ctrl-C) to every process
    of the step, workers included: a worker must keep scoring, so the step being checkpointed loses no item to
    'crashed'."""
    from mcpo_megatron.helper_signals import SCHEDULER_SIGNALS

    assert signal.SIGTERM in SCHEDULER_SIGNALS
    with MathVerifyScorer(num_workers=1, timeout_s=30.0, spare=False) as s:
        s.wait_ready()
        pid = s._workers[0].proc.pid
        for sig in SCHEDULER_SIGNALS:
            os.kill(pid, sig)
        time.sleep(0.5)
        res = s.score(["Answer: 1", "Answer: 3"], ["1", "2"])
        assert [r.status for r in res] == ["ok", "ok"] and _labels(res) == [1, 0]
        assert s._workers[0].proc.pid == pid and s.counters["crashed"] == 0 and s.counters["respawns"] == 0


def test_a_scorer_left_open_does_not_hold_up_the_exit():
    """Workers ignore SIGTERM, which multiprocessing's exit hook sends daemon children before joining them: the
    scorer stops them first, so a script that never closes its scorer still exits at once."""
    code = ("from mcpo_megatron.rewards.scorer import MathVerifyScorer\n"
            "if __name__ == '__main__':\n"
            "    s = MathVerifyScorer(num_workers=1, spare=False)\n"
            "    s.wait_ready()\n"
            "    print('ready', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ready" in proc.stdout, proc.stderr[-2000:]


def test_a_worker_that_died_while_idle_costs_no_item():
    with MathVerifyScorer(num_workers=1, timeout_s=30.0) as s:
        s.wait_ready()
        proc = s._workers[0].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        res = s.score(["Answer: 1", "Answer: 2"], ["1", "2"])
        assert [r.status for r in res] == ["ok", "ok"] and _labels(res) == [1, 1]
        assert s.counters["crashed"] == 0 and s.counters["respawns"] == 1


def test_total_time_is_bounded():
    with MathVerifyScorer(num_workers=1, timeout_s=30.0, total_timeout_s=2.0) as s:
        s.wait_ready()
        t0 = time.monotonic()
        res = s.score([HANG, "Answer: 1", "Answer: 2"], ["1", "1", "2"])
        wall = time.monotonic() - t0
    assert wall < 2.0 + RESPAWN_SLACK_S
    assert [r.status for r in res] == ["timeout"] * 3
    assert [r.score for r in res] == [-1.0] * 3


def test_truncated_flags_and_custom_scores():
    with MathVerifyScorer(num_workers=1, timeout_s=TABLE_TIMEOUT_S,
                          grading=Grading(correct_score=1.0, incorrect_score=0.0)) as s:
        res = s.score(["Answer: 3", "Answer: 4", "Answer: 5"], ["3", "3", "5"], truncated=[False, True, True])
    assert res == [
        RewardResult(score=1.0, correct=1, status="ok", extracted="3", truncated=False),
        RewardResult(score=0.0, correct=0, status="ok", extracted="4", truncated=True),
        RewardResult(score=1.0, correct=1, status="ok", extracted="5", truncated=True),
    ]


def test_empty_batch_and_bad_arguments(scorer):
    assert scorer.score([], []) == []
    with pytest.raises(ValueError, match="len\\(golds\\)=1 must equal len\\(responses\\)=2"):
        scorer.score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="truncated"):
        scorer.score(["a"], ["1"], truncated=[True, False])
    with pytest.raises(TypeError, match="golds\\[0\\]"):
        scorer.score(["a"], [1])
    with pytest.raises(ValueError, match="answer_format='latex'.*dapo"):
        Grading(answer_format="latex")
    with pytest.raises(ValueError, match="num_workers=0"):
        MathVerifyScorer(num_workers=0)


def test_timeout_and_memory_rules():
    """Refused at once: a deadline of inf seconds used to start the pool and fail in the first score() (selectors
    cannot wait inf seconds), and 16 MiB of address space is too little for a worker to import math-verify."""
    with pytest.raises(ValueError, match="timeout_s=inf is invalid: must be a finite number > 0"):
        MathVerifyScorer(timeout_s=float("inf"))
    with pytest.raises(ValueError, match="memory_mb=16 is invalid: must be 0 \\(no cap\\) or >= 64"):
        MathVerifyScorer(memory_mb=16)


def test_close_is_idempotent_and_score_after_close_fails():
    s = MathVerifyScorer(num_workers=1, timeout_s=TIMEOUT_S)
    procs = [w.proc for w in s._workers]
    s.close()
    s.close()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="after close"):
        s.score(["Answer: 1"], ["1"])


def test_workers_that_cannot_start_raise_a_clear_error(tmp_path, monkeypatch):
    # A site without math-verify: spawned workers take the parent's sys.path, where this stand-in shadows it
    from mcpo_megatron.rewards import RewardPoolError

    (tmp_path / "math_verify.py").write_text("raise ImportError('math-verify is not installed on this node')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = MathVerifyScorer(num_workers=1, timeout_s=TIMEOUT_S, startup_timeout_s=30)
    try:
        with pytest.raises(RewardPoolError, match="failed to start(.|\n)*math-verify is not installed"):
            s.score(["Answer: 1"], ["1"])
    finally:
        s.close()


def test_script_without_main_guard_gets_a_clear_error(tmp_path):
    """Workers are spawned and re-import the caller's script; without a `__main__` guard the script creates a
    scorer inside each worker. That used to surface as "worker pid N exited during startup"."""
    import subprocess
    import sys

    script = tmp_path / "score_unguarded.py"
    script.write_text("from mcpo_megatron.rewards import MathVerifyScorer\n"
                      "scorer = MathVerifyScorer(num_workers=1, spare=False)\n"
                      "print(scorer.score(['Answer: 2'], ['2']))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode != 0
    advice = (f"multiprocessing's 'spawn' method, which re-imports the main script ({script}) in every worker, and "
              f"that script creates a MathVerifyScorer (or trains) when it is imported. Put the code that scores or "
              f"trains under `if __name__ == \"__main__\":` in {script}")
    assert "RewardPoolError: reward workers cannot start: the reward workers are started with " + advice \
        in proc.stderr
    assert "exited during startup" not in proc.stderr
    guarded = tmp_path / "score_guarded.py"
    guarded.write_text("from mcpo_megatron.rewards import MathVerifyScorer\n"
                       "if __name__ == '__main__':\n"
                       "    with MathVerifyScorer(num_workers=1, spare=False) as scorer:\n"
                       "        print([r.correct for r in scorer.score(['Answer: 2'], ['2'])])\n")
    proc = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1]"
