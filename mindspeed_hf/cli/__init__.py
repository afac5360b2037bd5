"""The `mindspeed-hf` command (train | env | bench) and the embedded default run it trains."""
