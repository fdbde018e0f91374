"""Demo training jobs: one tiny transformer LM in PyTorch and its PaddlePaddle port, for exercising twinstep."""
