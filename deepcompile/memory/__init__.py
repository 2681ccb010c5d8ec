"""Device memory as a resource the planners share: the one budget every planner plans against
(``budget.py``)."""

from deepcompile.memory.budget import MemoryBudget, local_memory_budget, memory_budget

__all__ = ["MemoryBudget", "local_memory_budget", "memory_budget"]
