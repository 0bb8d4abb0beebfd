"""The serial tail's engine-side figure (#51 item 3): the scheduler counts the rows of every
decode step (`stats["decode_rows"]`), so the phase's mean decode batch is rows / steps
(`rollout/mean_decode_batch`); the critical path itself is computed from the recorded calls
(`records.critical_path_metrics`, tests/test_records.py)."""

from __future__ import annotations


def test_decode_rows_count_every_row_of_every_decode_step():
    from agl_lab.engines.serving.scheduler import BatchScheduler, SamplingParams
    from agl_lab.engines.tiny import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(device="cpu")
    sched = BatchScheduler(model, tok, batch_window_ms=0)
    try:
        sched.pause(wait=True)  # queue all three, then admit them in one prefill
        futures = [sched.submit([5, 6, 7], SamplingParams(max_tokens=n, seed=1, ignore_eos=True)) for n in (2, 4, 6)]
        sched.resume()
        results = [f.result(timeout=120) for f in futures]
    finally:
        sched.close()
    assert [len(r.token_ids) for r in results] == [2, 4, 6]
    # the prefill samples each first token; then 5 decode steps of 3, 2, 2, 1, 1 rows (the tail)
    assert sched.stats["prefills"] == 1
    assert sched.stats["steps"] == 5 and sched.stats["decode_rows"] == 3 + 2 + 2 + 1 + 1
