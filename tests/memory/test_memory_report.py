"""The memory report (`memory_report`, behind `mindspeed-hf bench --memory`): one row per memory setting, the parts
of the step peak, the same loss in every row, and activations ordered as the settings promise; a bad config is one
line and exit status 2."""

from __future__ import annotations

import re

from mindspeed_hf.bench.memory_report import MODES, memory_report

RUN = """\
model:
  config: {model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 16, max_position_embeddings: 64, tie_word_embeddings: true}
  tokenizer: builtin:tokenizer
data: {train: builtin:train.jsonl, eval: builtin:eval.jsonl, max_length: 32}
features: {offload_min_bytes: 0}
training: {per_device_train_batch_size: 8, seed: 0, report_to: none, output_dir: OUT}
"""


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in MODES:
            rows[cells[0]] = cells
    return rows


def test_report_rows(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(RUN.replace("OUT", str(tmp_path / "out")))
    assert memory_report(str(config), ["--per_device_train_batch_size", "4"]) == 0
    text = capsys.readouterr().out
    assert "one training step of 4 rows on cpu" in text
    rows = _rows(text)
    assert list(rows) == list(MODES)
    number = {mode: [float(re.sub(r"[x,]", "", c)) for c in cells[1:]] for mode, cells in rows.items()}
    params, grads, state, acts, _, peak, _, offloaded, loss = zip(*number.values())
    assert len(set(params)) == len(set(grads)) == len(set(state)) == len(set(loss)) == 1  # only activations move
    assert grads[0] == params[0] and state[0] == 2 * params[0]  # fp32 AdamW: exp_avg + exp_avg_sq (+ tiny steps)
    off, selective, full, offload = acts
    assert full < selective < off and offload < off
    assert offloaded[3] > 0 and offloaded[:3] == (0, 0, 0)
    assert all(abs(p - (a + b + c + d)) < 0.02 for p, a, b, c, d in zip(peak, params, grads, state, acts))


def test_bad_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(RUN.replace("offload_min_bytes: 0", "offload_min_bytes: -3").replace("OUT", str(tmp_path)))
    assert memory_report(str(config), []) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "memory.offload_min_bytes=-3 must be an integer >= 0" in err
