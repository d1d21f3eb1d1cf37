"""The timeline page's label layout and name shortening, on their own (pure Python: no torch, no browser)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sanitizer.reporting import label_layout as L
from sanitizer.reporting.label_layout import Anchor, Box, LabelRequest

DEMO_NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight",
              "model.layers.1.self_attn.k_proj.weight", "model.layers.3.mlp.experts.0.gate_proj.weight",
              "model.layers.10.input_layernorm.weight"]


def test_the_common_prefix_ends_at_a_component_boundary_and_leaves_every_name_its_own_part():
    assert L.common_prefix(DEMO_NAMES) == "model.layers."  # not 'model.layers.1' (1 vs 10), not mid-word
    assert L.common_prefix(["model.layers.3.x", "model.layers.3.y"]) == "model.layers.3."
    assert L.common_prefix(["layers.1.weight", "layers.10.weight"]) == "layers."
    assert L.common_prefix(["a.b", "a.b.c"]) == "a."  # 'a.b' would leave the first name empty
    assert L.common_prefix(["w[0]", "w[1]"]) == "w"  # a holder path's indices differ
    assert L.common_prefix(["only.one"]) == "" and L.common_prefix(["x", "x", None]) == ""
    assert L.common_prefix(["self_attn", "self_mlp"]) == ""  # a shared start inside a word is no prefix


def test_the_common_suffix_starts_at_a_boundary_and_never_eats_a_whole_name():
    prefix = L.common_prefix(DEMO_NAMES)
    assert L.common_suffix(DEMO_NAMES, prefix) == ".weight"
    assert L.common_suffix(DEMO_NAMES + ["model.layers.0.mlp.gate_proj.weight_scale"], prefix) == ""
    assert L.common_suffix(["a.w", "b.w"]) == ".w"
    assert L.common_suffix(["x.a.w", "x.w"], "x.") == ""  # 'x.w' minus 'x.' is 'w': nothing to cut
    assert [L.short_name(n, prefix, ".weight") for n in DEMO_NAMES[:2]] == ["0.self_attn.q_proj", "3.self_attn.q_proj"]
    assert L.short_name("other.name", prefix, ".weight") == "other.name"  # a name without them stays whole


def test_shortening_keeps_the_first_and_last_components_where_names_differ():
    name = "3.mlp.experts.0.gate_proj"
    assert L.shorten(name, 99) == name
    assert L.shorten(name, 22) == "3.\u2026experts.0.gate_proj"
    assert L.shorten(name, 21) == "3.\u20260.gate_proj"
    assert L.shorten(name, 14) == "3.\u20260.gate_proj"
    assert L.shorten(name, 12) == "3.\u2026gate_proj"
    for n in range(1, 30):
        assert len(L.shorten(name, n)) <= n
    assert L.shorten("abcdefghij", 5) == "a\u2026hij"
    with pytest.raises(ValueError, match="at least 1 character, got n=0"):
        L.shorten(name, 0)


def test_variants_go_from_the_whole_name_to_shorter_forms_that_keep_both_ends():
    v = L.variants("3.mlp.experts.0.gate_proj")
    assert v[0] == "3.mlp.experts.0.gate_proj" and "3.m.e.0.gate_proj" in v and "3.\u2026gate_proj" in v
    assert [len(x) for x in v] == sorted((len(x) for x in v), reverse=True) and len(set(v)) == len(v)
    assert all(x.startswith("3.") for x in v) and all(x.endswith("gate_proj") for x in v[:-1])
    assert len(v[-1]) <= 8
    assert L.variants("0.s.q_proj")[0] == "0.s.q_proj" and L.variants("x") == ["x"]


def test_a_text_box_is_its_text_length_wide_at_each_anchor():
    b = L.text_box("abcd", 100, 50, 10, "start")
    assert (b.x0, b.x1) == (100, 100 + 4 * L.CHAR_WIDTH * 10) and b.y0 < 50 < b.y1
    assert L.text_box("abcd", 100, 50, 10, "end").x1 == 100
    assert L.text_box("abcd", 100, 50, 10, "middle").x0 == 100 - 2 * L.CHAR_WIDTH * 10
    with pytest.raises(ValueError, match="'start', 'middle' or 'end', got 'left'"):
        L.text_box("a", 0, 0, 10, "left")
    mid = L.text_box("x", 0, L.baseline_centred(40, 10), 10)
    assert abs((mid.y0 + mid.y1) / 2 - 40) < 1e-9 and abs(mid.height - L.label_height(10)) < 1e-9


def test_a_label_goes_to_its_next_anchor_or_a_shorter_text_rather_than_over_another():
    area = Box(0, 0, 200, 100)
    first = LabelRequest(["aaaaaaaaaa"], [Anchor(10, 20)], 10, area)
    moved = LabelRequest(["bbbbbbbbbb"], [Anchor(12, 20), Anchor(12, 40)], 10, area)  # the first spot is taken
    shorter = LabelRequest(["cccccccccccccccccccccccccccccccccccc", "ccc"], [Anchor(150, 60)], 10, area)
    nowhere = LabelRequest(["dddd"], [Anchor(10, 20)], 10, area)  # only where 'first' is
    outside = LabelRequest(["eeee"], [Anchor(195, 80)], 10, area)  # would leave the area
    got = L.place_labels([first, moved, shorter, nowhere, outside])
    assert got[0].at == Anchor(10, 20) and got[1].at == Anchor(12, 40) and got[2].text == "ccc"
    assert got[3] is None and got[4] is None


def test_obstacles_solids_forms_and_the_order_of_tries():
    area = Box(0, 0, 300, 100)
    mark = Box(40, 10, 52, 22)
    blocked = LabelRequest(["xxxxxxxx"], [Anchor(30, 20), Anchor(30, 60)], 10, area)
    assert L.place_labels([blocked], obstacles=[mark])[0].at.y == 60
    red = Box(100, 0, 150, 100)
    over_red = LabelRequest(["yyyy"], [Anchor(110, 20)], 10, area, solid=True)
    assert L.place_labels([over_red], solids=[red])[0] is None
    assert L.place_labels([LabelRequest(["yyyy"], [Anchor(110, 20)], 10, area)], solids=[red])[0] is not None
    arrow = LabelRequest(["name"], [Anchor(5, 20, form="\u2193 {}")], 10, area)
    assert L.place_labels([arrow])[0].text == "\u2193 name"
    inside = Box(0, 0, 40, 30)  # an anchor of its own bounds: a label inside a box
    longest = LabelRequest(["long label", "#1"], [Anchor(2, 20, within=inside), Anchor(60, 20)], 10, area)
    assert L.place_labels([longest])[0].text == "long label"  # by default: the longest text, anywhere
    here = LabelRequest(["long label", "#1"], [Anchor(2, 20, within=inside), Anchor(60, 20)], 10, area,
                        place_first=True)
    got = L.place_labels([here])[0]
    assert got.text == "#1" and got.at.x == 2  # place first: a short label where it belongs


@st.composite
def _requests(draw):
    n = draw(st.integers(1, 60))
    out = []
    for _ in range(n):
        k = draw(st.integers(1, 4))
        anchors = [Anchor(draw(st.floats(-20, 420)), draw(st.floats(-10, 220)),
                          draw(st.sampled_from(["start", "end", "middle"]))) for _ in range(k)]
        words = draw(st.lists(st.text("abc.", min_size=1, max_size=30), min_size=1, max_size=3))
        out.append(LabelRequest(words, anchors, draw(st.sampled_from([9.0, 11.0, 12.0])), Box(0, 0, 400, 200)))
    return out


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(_requests())
def test_placed_labels_never_overlap_and_never_leave_their_bounds(requests):
    obstacles = [Box(50, 50, 70, 70), Box(300, 0, 310, 200)]
    got = L.place_labels(requests, obstacles=obstacles)
    assert len(got) == len(requests)
    boxes = [p.box for p in got if p is not None]
    for i, b in enumerate(boxes):
        assert b.inside(Box(0, 0, 400, 200))
        assert not any(b.overlaps(o) for o in obstacles)
        assert not any(b.overlaps(c) for c in boxes[:i])
    if got[0] is None:  # the first request has the first pick: only its bounds and the obstacles can stop it
        req = requests[0]
        for option in req.options:
            for a in req.anchors:
                b = L.text_box(a.form.format(option), a.x, a.y, req.size, a.anchor)
                assert not b.inside(req.within) or any(b.overlaps(o) for o in obstacles), (option, a)


def test_a_thousand_labels_are_laid_out_fast():
    rnd = random.Random(0)
    area = Box(0, 0, 1100, 500)
    reqs = [LabelRequest(L.variants(f"layer.{i}.mlp.experts.{i % 7}.gate_proj"),
                         [Anchor(rnd.uniform(0, 1100), rnd.uniform(0, 500)) for _ in range(8)], 12, area)
            for i in range(1000)]
    import time

    t = time.perf_counter()
    got = L.place_labels(reqs)
    assert time.perf_counter() - t < 5.0  # ~0.3 s on a quiet core; a shared CI core is slower
    assert 50 < sum(p is not None for p in got) < 1000


def test_nice_steps():
    assert [L.nice_step(x) for x in (0.2, 1, 1.5, 3, 7, 11, 45, 51)] == [1, 1, 2, 5, 10, 20, 50, 100]


def test_a_free_anchor_keeps_clear_of_every_shape_and_a_guide_of_every_label():
    inside = Box(0, 0, 100, 20)
    # beside a box (free): not over another shape, even when the request is not solid
    req = LabelRequest(["abc"], [Anchor(0, 15, free=True), Anchor(0, 45, free=True)], 10, Box(0, 0, 200, 200))
    (got,) = L.place_labels([req], shapes=[inside])
    assert got.at.y == 45 and not got.box.overlaps(inside)
    # a guide from a label down: a later label on a lower row never crosses it, nor the guide a later label
    first = LabelRequest(["a"], [Anchor(50, 10, guide=Box(49, 13.2, 51, 100))], 10, Box(0, 0, 200, 200))
    second = LabelRequest(["crossing"], [Anchor(40, 40), Anchor(100, 40)], 10, Box(0, 0, 200, 200))
    a, b = L.place_labels([first, second])
    assert b.at.x == 100 and not b.box.overlaps(a.at.guide)
    lower = LabelRequest(["zz"], [Anchor(45, 60)], 10, Box(0, 0, 200, 200))  # the label itself would cross it
    late = LabelRequest(["g"], [Anchor(140, 10, guide=Box(139, 13, 141, 100)), Anchor(170, 10)], 10,
                        Box(0, 0, 200, 200))
    _, _, c, d = L.place_labels([first, second, lower, late])
    assert c is None and d.at.x == 170  # 'late's guide would cross 'second' (placed at x=100..148)
    # a gap: two labels on one row never touch
    left = LabelRequest(["aaaa"], [Anchor(0, 10)], 10, Box(0, 0, 200, 20), gap=6)
    right = LabelRequest(["bbbb"], [Anchor(24, 10), Anchor(30, 10)], 10, Box(0, 0, 200, 20), gap=6)
    _, r = L.place_labels([left, right])
    assert r.at.x == 30 and r.option == "bbbb"


def test_abbreviations_say_what_each_initial_stands_for():
    assert L.abbreviations("0.self_attn.q_proj", "0.s.q_proj") == [("s", "self_attn")]
    assert L.abbreviations("3.mlp.experts.0.gate_proj", "3.m.e.0.gate_proj") == [("m", "mlp"), ("e", "experts")]
    assert L.abbreviations("3.mlp.experts.0.gate_proj", "3.\u2026gate_proj") == []  # left out, not initials
    assert L.abbreviations("x.y", "x.y") == []
