"""Generated tasks (ListOps, associative recall, copy, character LM) and the training loop."""

from effattn.tasks.data import TASKS, Task, make_task
from effattn.tasks.train import TrainConfig, applicability, train

__all__ = ["TASKS", "Task", "TrainConfig", "applicability", "make_task", "train"]
