"""MoE training aids that ride on a model, whoever trains it (Trainer or an accelerate loop): the expert-load counters
(load.py, `moe.log_load`) and auxiliary-loss-free balancing (balance.py, `moe.balance: aux_free`)."""

from .balance import AuxFreeBalance
from .load import ExpertLoad, with_load

__all__ = ["AuxFreeBalance", "ExpertLoad", "with_load"]
