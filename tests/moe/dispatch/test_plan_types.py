"""The dispatch plans are typed per transport: each plan class holds exactly its transport's
fields (none Optional), and `moe/` branches on the plan's type, not on transport strings."""

import ast
import dataclasses
import pathlib
import types
import typing

import jax
import jax.numpy as jnp
import pytest

import moe
from moe.dispatch import plan as dispatch_plan
from moe.dispatch import plan_build

PLANS = (dispatch_plan.DensePlan, dispatch_plan.RaggedPlan, dispatch_plan.DroplessPlan)
MOE = pathlib.Path(moe.__file__).parent
MAX_TRANSPORT_STRING_COMPARES = 6  # issue 40's target for all of moe/


def _has_none(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) \
        and type(None) in typing.get_args(hint)


@pytest.mark.parametrize("cls", PLANS, ids=lambda c: c.__name__)
def test_plan_fields_are_never_optional(cls):
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    assert fields and "transport" not in {f.name for f in fields}  # a class attribute
    optional = [f.name for f in fields if _has_none(hints[f.name])]
    assert not optional, f"{cls.__name__} has Optional fields {optional}"
    assert not [f.name for f in fields if f.default is not dataclasses.MISSING]


def _is_transport(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return isinstance(name, str) and name.endswith("transport")


def _is_strings(node) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_strings(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _transport_string_compares(tree: ast.AST) -> list[int]:
    """Lines of the comparisons in ``tree`` of a name / attribute ending in ``transport`` with
    a string literal (or a tuple / list of them: ``in``, ``not in``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any((_is_transport(a) and _is_strings(b)) or (_is_transport(b) and _is_strings(a))
                   for a, b in zip(sides[:-1], sides[1:], strict=True)):
                lines.append(node.lineno)
    return lines


def test_the_counter_sees_each_form():
    src = ("a = t.transport == 'dense'\nb = 'x' != transport\nc = transport in ('a', 'b')\n"
           "d = plan.transport not in ['a']\ne = transport == other\nf = mode == 'dense'\n"
           "g = 0 < n == len(transport) != 'x'\n")
    assert _transport_string_compares(ast.parse(src)) == [1, 2, 3, 4]


def test_transport_string_compares_are_few():
    found = [f"{path.relative_to(MOE.parent)}:{line}" for path in sorted(MOE.rglob("*.py"))
             for line in _transport_string_compares(ast.parse(path.read_text(), str(path)))]
    assert len(found) <= MAX_TRANSPORT_STRING_COMPARES, found
    # The plans, their builders and the movement branch on the plan's type only.
    owned = ("moe/dispatch/", "moe/experts/fused_combine.py")
    assert not [f for f in found if f.startswith(owned)], found


def _plans():
    """One plan of each transport for 2 tokens, top-2 of 4 experts, one device."""
    ids = jnp.array([[2, 0], [2, 1]], jnp.int32)
    statics = plan_build.PlanStatics(num_experts=4, axis_name="expert", axis_size=1,
                                     x_dtype="float32", block_size=128)
    return (plan_build.dense_plan(ids, statics, capacity=8),
            plan_build.ragged_plan(ids, statics, exchange_implementation="native"),
            plan_build.dropless_plan(ids, statics, buckets=(4,)))


def test_each_builder_gives_its_plan_type_with_the_shared_properties():
    for plan, cls, name in zip(_plans(), PLANS, ("dense", "ragged", "dropless"), strict=True):
        assert type(plan) is cls and isinstance(plan, moe.DispatchPlan)
        assert plan.transport == name == cls.transport
        assert (plan.num_local_experts, plan.num_tokens, plan.top_k) == (4, 2, 2)
        assert plan.kept.shape == (2, 2) and bool(plan.kept.all())
        assert int(plan.dropped) == 0
        assert plan.group_sizes.tolist() == [1, 1, 2, 0]
        # a registered pytree: the statics are metadata, the arrays leaves
        leaves, tree = jax.tree.flatten(plan)
        assert all(isinstance(x, jax.Array) for x in leaves)
        assert jax.tree.unflatten(tree, leaves).expert_shape(8) == plan.expert_shape(8)
    dense, ragged, dropless = _plans()
    assert dense.expert_shape(8) == (4, 8, 8)
    assert ragged.expert_shape(8) == dropless.expert_shape(8) == (4, 8)
    assert ragged.layout_rows == dropless.layout_rows == 4 == dropless.pair_width
    assert ragged.send_slot.tolist() == [1, 3, 0, 2]  # slots by (expert, t, j)
    assert not isinstance(jnp.zeros(()), moe.DispatchPlan)
