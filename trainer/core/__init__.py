"""The run machinery shared by every task: training loop, checkpoints, resume, distribution, logging."""
