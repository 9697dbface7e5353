"""The colocated trainer: planted-teacher data, DLRM with a Megatron-style MoE block, online training that publishes.

``data`` and ``metrics`` need only NumPy; everything else needs the optional ``trainer`` extra (torch).
"""
