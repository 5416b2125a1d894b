"""How many trainer ranks a parallel layout needs (torch-free, so scenario data can ask it cheaply)."""

from __future__ import annotations

import math


def world_size_for(tp: int, pp: int, ep: int = 1, etp: int = 1) -> int:
    """Trainer ranks for a layout: PP x lcm(TP, EP x ETP).

    megatron-core needs the world divisible by TP x PP (dense DP = the rest) and by ETP x EP x PP
    (expert DP = the rest); the smallest such world is this one.
    """
    return pp * math.lcm(tp, ep * etp)
