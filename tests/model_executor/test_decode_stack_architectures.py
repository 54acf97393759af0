

def test_the_set_is_given_field_by_field() -> None:
    """Windows and soft-caps are arguments (any value); a set must name every LayerArithmetic field, so a
    field added later is outside every stack until someone says what it computes."""
    from radixserve.models.base import ANY_VALUE, LayerArithmetic, LayerArithmeticSet

    gemma2 = LayerArithmetic("sandwich", False, "gelu_tanh", False, False, 4096, 50.0)
    assert gemma2 in DECODE_STACK_LAYERS
    phi3 = LayerArithmetic("pre", False, "silu", False, True, None, None)
    assert phi3 not in DECODE_STACK_LAYERS and DECODE_STACK_LAYERS.outside(phi3) == ["partial_rotary=True"]
    assert "not a record" not in DECODE_STACK_LAYERS
    with pytest.raises(ValueError, match="names every field"):
        LayerArithmeticSet(norms=ANY_VALUE)
