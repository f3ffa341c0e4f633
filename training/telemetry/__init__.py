"""What a run logs (training stage): step metrics and the JSONL step log, the metrics logger, curves.png, live tracking."""
