def cdiv(numerator, denominator):
    """Ceiling division, for ints and integer tensors alike: the blocks `numerator` tokens need."""
    return -(-numerator // denominator)
