"""Token-budget batches over 2 data-parallel ranks (torchrun, gloo; a plain Trainer script, the budget only from
MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH): both ranks train the same number of steps, no batch exceeds the budget, and
in each epoch the ranks' rows together are every row exactly once; resumed from the checkpoint of step 2, each rank
trains the batches the uninterrupted run trained after it."""

from __future__ import annotations

from pathlib import Path

from child_runs import child_env, run_worker

HERE = Path(__file__).resolve().parent


def test_two_ranks_get_equal_steps_every_row_once_per_epoch_and_resume_exactly(tmp_path):
    env = child_env(auto=True, MINDSPEED_HF_DATA_MAX_TOKENS_PER_BATCH="96")
    env["PYTHONPATH"] = f"{HERE.parent / 'trainer'}:{HERE.parent}:{env['PYTHONPATH']}"
    report = run_worker(HERE / "token_budget_worker.py", tmp_path / "report.json", env=env)
    ranks = report["ranks"]
    steps = {len(r["batches"]) for r in ranks}
    assert len(steps) == 1 and steps.pop() % 2 == 0, [len(r["batches"]) for r in ranks]
    assert max(t for r in ranks for t in r["tokens"]) <= 96
    per_epoch = len(ranks[0]["batches"]) // 2
    for epoch in range(2):
        seen = [d for r in ranks for b in r["batches"][epoch * per_epoch:(epoch + 1) * per_epoch] for d in b]
        assert sorted(seen) == sorted(report["rows"])
    for rank in ranks:
        assert rank["resumed"] == rank["batches"][2:]
