"""What a step costs: FLOPs, bytes and memory from XLA, the roofline, `summary`."""
