"""Generated tasks (ListOps, associative recall, copy, reverse, character LM): deterministic
training batches and held-out sets (:mod:`effattn.tools.tasks.data`)."""

from effattn.tools.tasks.data import TASKS, Task, make_task

__all__ = ["TASKS", "Task", "make_task"]
