"""Runtime (layer 2: torch and torch.distributed, never megatron, never the planner).

Tensor names carry shapes: ``t`` = this rank's tokens, ``T`` = all tokens of the group, ``N`` = all
heads, ``n`` = this rank's heads (N / group size), ``H`` = head dim (or features per head).
Ulysses: ``q_tNH -> seq_to_head -> q_TnH -> attention -> o_TnH -> head_to_seq -> o_tNH``.
"""
