"""The bridge export's per-stage task selection: which PP stage exports a parameter several stages hold."""

from __future__ import annotations

from reference_impl.export.bridge import lowest_stage


def test_a_name_held_by_several_stages_goes_to_the_lowest() -> None:
    per_stage = [
        ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"],
        ["decoder.layers.1.mlp.linear_fc1.weight", "embedding.word_embeddings.weight", "output_layer.weight"],
    ]
    assert lowest_stage(per_stage) == {
        "embedding.word_embeddings.weight": 0,
        "decoder.layers.0.mlp.linear_fc1.weight": 0,
        "decoder.layers.1.mlp.linear_fc1.weight": 1,
        "output_layer.weight": 1,
    }


def test_a_stage_holding_nothing_owns_nothing() -> None:
    assert lowest_stage([[], ["a"], ["a", "b"]]) == {"a": 1, "b": 2}
