"""Load transformers' MoE blocks into :class:`moe.MoE`: parameters and options.

:func:`from_transformers` takes one block's parameters as arrays (numpy, or anything
``np.asarray`` reads: no torch import here) keyed as in a transformers state dict, plus the
family's config values, and returns the :class:`moe.MoE` params and the
:class:`moe.MoEOptions` that compute the same block; :func:`load` puts such params into a
module, keeping its shardings. Families and the keys they read (relative to the block,
e.g. ``model.layers.3.block_sparse_moe.`` passed as ``prefix``):

* ``'mixtral'``: ``gate.weight [E, d]``; ``experts.{i}.w1`` (gate) / ``w3`` (up)
  ``.weight [f, d]``, ``w2.weight [d, f]``.
* ``'qwen3_moe'``: ``gate.weight``; ``experts.{i}.gate_proj`` / ``up_proj`` / ``down_proj``
  ``.weight``.
* ``'qwen2_moe'``: as Qwen3-MoE, plus ``shared_expert.{gate,up,down}_proj.weight`` and
  ``shared_expert_gate.weight [1, d]`` (the shared width a multiple of the experts').
* ``'deepseek_v3'``: ``gate.weight``, ``gate.e_score_correction_bias [E]`` (the balancing
  bias), ``experts.{i}.{gate,up,down}_proj.weight``, ``shared_experts.{gate,up,down}_proj
  .weight``.
* ``'gpt_oss'``: ``router.weight [E, d]``, ``router.bias [E]``, ``experts.gate_up_proj
  [E, d, 2f]`` (gate and up columns interleaved: gate ``[..., ::2]``, up ``[..., 1::2]``),
  ``experts.gate_up_proj_bias [E, 2f]`` (interleaved alike), ``experts.down_proj [E, f, d]``,
  ``experts.down_proj_bias [E, d]`` (dequantized: the Hub's MXFP4 blocks are not read
  here).

The config values each family reads, and every name transformers (4.x and 5.x) and the Hub's
``config.json`` files give them, are :data:`CONFIG_KEYS`: e.g. Qwen3-MoE's expert count is
``num_experts`` in transformers 4 and ``num_local_experts`` in transformers 5's
``to_dict()``, DeepSeek-V3's ``n_routed_experts`` (also ``num_local_experts``). A value the
config lacks takes transformers' default, except the required ones (expert count, experts
per token, DeepSeek-V3's groups), whose absence is an error naming the key.

Mixtral, Qwen and DeepSeek experts may also come fused, as transformers 5 stores them:
``experts.gate_up_proj [E, 2f, d]`` (gate rows first) and ``experts.down_proj [E, d, f]``.
Torch ``Linear`` weights are ``[out, in]``; ours are ``[in, out]`` kernels, with expert banks
``w_gate_up [E, d, 2f]`` = ``[gate | up]`` columns and ``w_down [E, f, d]``.

Semantics kept: top-k of the softmax (or DeepSeek's sigmoid plus correction bias, with
group-limited selection), renormalization as ``norm_topk_prob`` says, ``routed_scaling``,
the activation (:class:`moe.activations.GatedActivation`), biases and the shared experts.
One difference: transformers' load-balancing loss is ``top_k`` times ``aux
['load_balance_loss']`` (see :mod:`moe.routing`).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from accel_kernels.activations import GatedActivation
from moe.options import MoEOptions

__all__ = ["CONFIG_KEYS", "FAMILIES", "ConfigKey", "from_transformers", "load"]

Family = Literal["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")

# transformers' hidden_act names -> our activation kinds.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh":
                "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# (gate, up, down) names of one expert's Linear layers.
_PROJ = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One config value a family reads: the names it goes by and its default.

    Attributes:
      spellings: every name of the value, looked up in this order: the transformers 4.x
        attribute, then the 5.x ``to_dict()`` name or ``attribute_map`` alias (and, for
        GPT-OSS's experts per token, the original ``config.json``'s name).
      required: the config must hold one spelling (its transformers default is one
        checkpoint's size, not a convention); else ``default`` applies.
      default: transformers' default (for a config without any spelling).

    Example:
      >>> CONFIG_KEYS["qwen3_moe"]["num_experts"].spellings
      ('num_experts', 'num_local_experts')
    """

    spellings: tuple[str, ...]
    required: bool = False
    default: Any = None


_TOP_K = ConfigKey(("num_experts_per_tok",), required=True)
_ACT = ConfigKey(("hidden_act",), default="silu")
CONFIG_KEYS: dict[str, dict[str, ConfigKey]] = {
    "mixtral": {
        "num_experts": ConfigKey(("num_local_experts", "num_experts"), required=True),
        "top_k": _TOP_K, "hidden_act": _ACT,
        "router_jitter_noise": ConfigKey(("router_jitter_noise",), default=0.0),
    },
    "qwen2_moe": {
        "num_experts": ConfigKey(("num_experts", "num_local_experts"), required=True),
        "top_k": _TOP_K, "hidden_act": _ACT,
        "norm_topk_prob": ConfigKey(("norm_topk_prob",), default=False),
    },
    "qwen3_moe": {
        "num_experts": ConfigKey(("num_experts", "num_local_experts"), required=True),
        "top_k": _TOP_K, "hidden_act": _ACT,
        "norm_topk_prob": ConfigKey(("norm_topk_prob",), default=False),
    },
    "deepseek_v3": {
        "num_experts": ConfigKey(("n_routed_experts", "num_local_experts"), required=True),
        "top_k": _TOP_K, "hidden_act": _ACT,
        "n_group": ConfigKey(("n_group",), required=True),
        "topk_group": ConfigKey(("topk_group",), required=True),
        "norm_topk_prob": ConfigKey(("norm_topk_prob",), default=True),
        "routed_scaling_factor": ConfigKey(("routed_scaling_factor",), default=2.5),
        "n_shared_experts": ConfigKey(("n_shared_experts",), default=1),
        "scoring_func": ConfigKey(("scoring_func",), default="sigmoid"),
        "topk_method": ConfigKey(("topk_method",), default="noaux_tc"),
    },
    "gpt_oss": {
        "num_experts": ConfigKey(("num_local_experts", "num_experts"), required=True),
        "top_k": ConfigKey(("num_experts_per_tok", "experts_per_token"), required=True),
        "swiglu_alpha": ConfigKey(("swiglu_alpha",), default=1.702),
        "swiglu_limit": ConfigKey(("swiglu_limit",), default=7.0),
    },
}
"""Per family, the config values :func:`from_transformers` reads: our name -> :class:`ConfigKey`
(the spellings transformers 4.x / 5.x and the Hub use, required or transformers' default)."""


def _config_dict(config: Any) -> Mapping[str, Any]:
    """``config`` as a mapping: a dict as is, a transformers config by its ``to_dict()``."""
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"config must be a dict of config values or a transformers config, got "
                    f"{type(config).__name__}; pass hf_config or hf_config.to_dict().")


def _read_config(family: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The family's config values by our names (:data:`CONFIG_KEYS`), defaults filled in."""
    values = {}
    for name, key in CONFIG_KEYS[family].items():
        found = [(s, config[s]) for s in key.spellings if s in config]
        if any(v != found[0][1] for _, v in found[1:]):
            raise ValueError(f"config gives {name} as {dict(found)}, which disagree; pass one "
                             "of them.")
        if found:
            values[name] = found[0][1]
        elif key.required:
            others = "".join(f" or {s!r}" for s in key.spellings[1:])
            raise ValueError(f"config lacks {key.spellings[0]!r}{others}, which a {family} block "
                             "needs; pass the model's config (hf_config, or "
                             "hf_config.to_dict()).")
        else:
            values[name] = key.default
    return values


def _int_value(family: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` (the config's ``name``) as an int ``>= minimum``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        spellings = CONFIG_KEYS[family][name].spellings
        raise ValueError(f"the {family} config's {spellings[0]!r} is {value!r}; it must be an "
                         f"int >= {minimum}.")
    return int(value)


class _Block:
    """The block's arrays by key (after the prefix), with errors that name missing keys."""

    def __init__(self, params: Mapping[str, Any], prefix: str, family: str):
        self.family = family
        self.prefix = prefix
        self.arrays = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        if not self.arrays:
            raise ValueError(f"no parameter key starts with prefix={prefix!r}; pass the "
                             "block's keys (e.g. 'gate.weight') or the prefix they share.")

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    def get(self, key: str, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
        if key not in self.arrays:
            raise ValueError(f"missing {self.family} parameter {self.prefix + key!r}.")
        a = np.asarray(self.arrays[key])
        if shape is not None and (a.ndim != len(shape) or any(
                w is not None and w != n for w, n in zip(shape, a.shape, strict=True))):
            want = tuple("?" if w is None else w for w in shape)
            raise ValueError(f"{self.prefix + key!r} has shape {a.shape}; expected {want}.")
        return a


def _experts(block: _Block, e: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``(w_gate_up [E, d, 2f], w_down [E, f, d])`` from per-expert or fused keys."""
    if "experts.gate_up_proj" in block:  # transformers 5: fused [E, 2f, d] and [E, d, f]
        gu = block.get("experts.gate_up_proj", (e, None, d))
        f = gu.shape[1] // 2
        dn = block.get("experts.down_proj", (e, d, f))
        return gu.transpose(0, 2, 1), dn.transpose(0, 2, 1)
    g_name, u_name, d_name = _PROJ.get(block.family, _DEFAULT_PROJ)
    found = {int(m.group(1)) for k in block.arrays if (m := re.match(r"experts\.(\d+)\.", k))}
    if found != set(range(e)):
        raise ValueError(f"the block holds experts {sorted(found)[:8]}...; expected experts "
                         f"0..{e - 1} (num experts {e} from the config).")
    gate = block.get(f"experts.0.{g_name}.weight", (None, d))
    f = gate.shape[0]
    gus, dns = [], []
    for i in range(e):
        g = block.get(f"experts.{i}.{g_name}.weight", (f, d))
        u = block.get(f"experts.{i}.{u_name}.weight", (f, d))
        gus.append(np.concatenate([g.T, u.T], axis=1))
        dns.append(block.get(f"experts.{i}.{d_name}.weight", (d, f)).T)
    return np.stack(gus), np.stack(dns)


def _shared(block: _Block, name: str, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shared_gate_up [d, 2f_s], shared_down [f_s, d])`` from one MLP's Linear weights."""
    g = block.get(f"{name}.gate_proj.weight", (None, d))
    u = block.get(f"{name}.up_proj.weight", g.shape)
    dn = block.get(f"{name}.down_proj.weight", (d, g.shape[0]))
    return np.concatenate([g.T, u.T], axis=1), dn.T


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """GPT-OSS's interleaved gate/up columns ``[g0, u0, g1, u1, ...]`` -> ``[gate | up]``."""
    return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)


def from_transformers(
    family: Family,
    params: Mapping[str, Any],
    config: Mapping[str, Any] | Any,
    *,
    prefix: str = "",
    **options: Any,
) -> tuple[dict[str, np.ndarray], MoEOptions]:
    """The :class:`moe.MoE` params and options of one transformers MoE block.

    Args:
      family: ``'mixtral'``, ``'qwen2_moe'``, ``'qwen3_moe'``, ``'deepseek_v3'`` or
        ``'gpt_oss'`` (keys and config values: see the module docstring).
      params: the block's arrays keyed as in the transformers state dict (numpy arrays, or
        CPU tensors: anything ``np.asarray`` takes); keys not under ``prefix`` are ignored.
      config: the model's config: a transformers config, or its values as a dict
        (``hf_config.to_dict()``, a Hub ``config.json``); read as :data:`CONFIG_KEYS` says.
      prefix: the block's key prefix, e.g. ``'model.layers.3.mlp.'``.
      **options: further :class:`moe.MoEOptions` fields (``transport``, ``dispatch_dtype``,
        ...), applied after the family's.

    Returns:
      ``(params, options)``: ``params`` a dict of numpy arrays named as the module's
      variables (``router_kernel``, ``w_gate_up``, ``w_down`` and, as the family has them,
      ``balancing_bias``, ``router_bias``, ``b_gate_up``, ``b_down``, ``shared_gate_up``,
      ``shared_down``, ``shared_gate``); ``options`` a :class:`moe.MoEOptions`. Build the
      layer with ``moe.MoE(d_model, d_ff, options=options, ...)`` (``d_model, d_ff =
      params['w_down'].shape[2], params['w_down'].shape[1]``) and :func:`load` the params.

    Raises:
      ValueError: an unknown family, a missing key or required config value (named with its
        accepted spellings), a config value out of range, or a shape that does not match the
        others.
      TypeError: ``params``, ``config`` or ``prefix`` of the wrong type.

    Example:
      >>> import numpy as np
      >>> e, d, f = 4, 8, 6
      >>> rng = np.random.default_rng(0)
      >>> block = {"gate.weight": rng.normal(size=(e, d))}
      >>> for i in range(e):
      ...     block |= {f"experts.{i}.w1.weight": rng.normal(size=(f, d)),
      ...               f"experts.{i}.w3.weight": rng.normal(size=(f, d)),
      ...               f"experts.{i}.w2.weight": rng.normal(size=(d, f))}
      >>> params, options = from_transformers(
      ...     "mixtral", block, {"num_local_experts": e, "num_experts_per_tok": 2})
      >>> params["w_gate_up"].shape, params["w_down"].shape, options.router.top_k
      ((4, 8, 12), (4, 6, 8), 2)

    References:
      transformers' modeling files: MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
      Qwen3MoeSparseMoeBlock, DeepseekV3MoE, GptOssMLP.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; use one of {FAMILIES}.")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of the block's arrays by state-dict key, got "
                        f"{type(params).__name__}; pass e.g. dict(model.state_dict()) or a "
                        "safetensors file's tensors.")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str (the block's key prefix, e.g. "
                        f"'model.layers.3.mlp.'), got {prefix!r}.")
    e, k, kw = _config_options(family, _read_config(family, _config_dict(config)))
    block = _Block(params, prefix, family)
    router_key = "router.weight" if family == "gpt_oss" else "gate.weight"
    router = block.get(router_key, (e, None))
    d = router.shape[1]
    out: dict[str, np.ndarray] = {"router_kernel": router.T}
    if family == "gpt_oss":
        gu = block.get("experts.gate_up_proj", (e, d, None))
        f = gu.shape[2] // 2
        out["w_gate_up"] = _deinterleave(gu)
        out["w_down"] = block.get("experts.down_proj", (e, f, d))
        out["router_bias"] = block.get("router.bias", (e,))
        out["b_gate_up"] = _deinterleave(block.get("experts.gate_up_proj_bias", (e, 2 * f)))
        out["b_down"] = block.get("experts.down_proj_bias", (e, d))
    else:
        out["w_gate_up"], out["w_down"] = _experts(block, e, d)
        f = out["w_down"].shape[1]
    if family == "qwen2_moe":
        out["shared_gate_up"], out["shared_down"] = _shared(block, "shared_expert", d)
        f_shared = out["shared_down"].shape[0]
        if f_shared % f:
            raise ValueError(f"shared_expert width {f_shared} is not a multiple of the expert "
                             f"width {f}; moe.MoE's shared experts are num_shared_experts * "
                             "d_ff wide.")
        out["shared_gate"] = block.get("shared_expert_gate.weight", (1, d)).T
        kw.update(num_shared_experts=f_shared // f, shared_expert_gate=True)
    if family == "deepseek_v3":
        if "gate.e_score_correction_bias" in block:
            out["balancing_bias"] = block.get("gate.e_score_correction_bias", (e,))
        n_shared = kw.get("num_shared_experts", 0)
        if n_shared:
            if "shared_experts.gate_proj.weight" not in block:
                raise ValueError(
                    f"n_shared_experts={n_shared} (the config's, or transformers' default 1) "
                    f"but the block has no {prefix + 'shared_experts.gate_proj.weight'!r}; "
                    "pass the block's shared experts, or n_shared_experts=0 in the config.")
            out["shared_gate_up"], out["shared_down"] = _shared(block, "shared_experts", d)
            if out["shared_down"].shape[0] != n_shared * f:
                raise ValueError(f"shared_experts width {out['shared_down'].shape[0]} != "
                                 f"n_shared_experts * moe_intermediate_size = {n_shared * f}.")
    return out, MoEOptions.create(e, k, **kw).replace(**options)


def _config_options(family: str, values: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """``(num_experts, top_k, options)`` from the family's config values (``_read_config``),
    each checked, and the options they give checked together (errors name the config keys)."""
    e = _int_value(family, "num_experts", values["num_experts"])
    k = _int_value(family, "top_k", values["top_k"])
    kw: dict[str, Any] = {}
    if "hidden_act" in values:
        act = values["hidden_act"]
        if not isinstance(act, str) or act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} has no equivalent; supported: "
                             f"{sorted(_ACTIVATIONS)}.")
        kw.update(activation=_ACTIVATIONS[act])
    if family == "mixtral":
        kw.update(router_jitter_noise=values["router_jitter_noise"] or 0.0)
    if family in ("qwen2_moe", "qwen3_moe"):
        kw.update(renormalize=bool(values["norm_topk_prob"]))
    if family == "gpt_oss":
        kw.update(activation=GatedActivation("clamped_swiglu", alpha=values["swiglu_alpha"],
                                             limit=values["swiglu_limit"]),
                  router_bias=True, expert_bias=True)
    if family == "deepseek_v3":
        if values["scoring_func"] not in ("sigmoid", None):
            raise ValueError(f"deepseek_v3 scoring_func={values['scoring_func']!r}; only "
                             "'sigmoid' (DeepSeek-V3) is supported.")
        if values["topk_method"] not in ("noaux_tc", None):
            raise ValueError(f"deepseek_v3 topk_method={values['topk_method']!r}; only "
                             "'noaux_tc' (DeepSeek-V3's group-limited top-k) is supported.")
        g, tg = values["n_group"], values["topk_group"]
        g = 1 if g is None else _int_value(family, "n_group", g)  # None: no groups
        tg = None if tg is None else _int_value(family, "topk_group", tg)
        kw.update(score_fn="sigmoid", renormalize=bool(values["norm_topk_prob"]),
                  routed_scaling=values["routed_scaling_factor"], num_groups=g, topk_groups=tg,
                  num_shared_experts=_int_value(family, "n_shared_experts",
                                                values["n_shared_experts"] or 0, minimum=0))
    try:
        MoEOptions.create(e, k, **kw)
    except (ValueError, TypeError) as err:
        given = {CONFIG_KEYS[family][n].spellings[0]: v for n, v in values.items()}
        raise ValueError(f"the {family} config's values {given} give no valid options: "
                         f"{err}") from err
    return e, k, kw


def load(model: nnx.Module, params: Mapping[str, Any]) -> None:
    """Put ``params`` (from :func:`from_transformers`) into ``model``'s variables, in place.

    Each value is cast to the variable's dtype and placed with its current sharding. Every
    ``nnx.Param`` of the model must be given (the balancing bias may be left out: it keeps
    its value).

    Args:
      model: a :class:`moe.MoE`.
      params: arrays named as the model's variables.

    Raises:
      ValueError: a name the model lacks, a shape mismatch, or a parameter left out.
      TypeError: ``model`` is not a module or ``params`` not a mapping.

    Example:
      >>> # params, options = from_transformers("qwen3_moe", block, config)
      >>> # layer = moe.MoE(d, f, options=options, rngs=nnx.Rngs(0)); load(layer, params)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module (a moe.MoE), got {type(model).__name__}; "
                        "build it with moe.MoE(d_model, d_ff, options=options, rngs=...).")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays by variable name (from "
                        f"from_transformers), got {type(params).__name__}.")
    wanted = {name for name, v in vars(model).items() if isinstance(v, nnx.Param)}
    missing = wanted - set(params)
    if missing:
        raise ValueError(f"params lack {sorted(missing)}, which the model has; convert with "
                         "the same options the model was built with.")
    for name, value in params.items():
        var = getattr(model, name, None)
        if not isinstance(var, nnx.Variable):
            raise ValueError(f"the model has no variable {name!r} (its options do not enable "
                             "it); build it with the options from_transformers returned.")
        current = var[...]
        value = np.asarray(value)
        if value.shape != current.shape:
            raise ValueError(f"{name}: shape {value.shape} does not match the model's "
                             f"{current.shape}.")
        var[...] = jax.device_put(jnp.asarray(value, current.dtype), current.sharding)
