"""The removal-cost predictors BASE ranks experts with: per MoE layer, ``g = z @ weight.T + bias ~ log||E_u(z)||``.

A :class:`Predictors` holds, for every MoE layer (keyed by the model's decoder-layer index):

* ``weight [E, H]`` and ``bias [E]`` (fp32): the linear predictor of each expert's output log-norm,
* ``mean_log_norm [E]`` (fp32): each expert's mean log-norm over the calibration tokens (the
  ``static_energy`` baseline),
* ``r2``: the predictor's held-out R^2 for the layer,
* ``similarity [E, E]`` (fp32, optional: ``calibrate(..., similarity=True)``): the cosine similarity of every two
  experts' outputs over the calibration tokens, which the ``substitute`` fill rule moves dropped slots by,

and ``metadata`` describing the model it was calibrated on. :func:`base_moe.calibrate` produces one;
``save``/``load`` write and read it as a safetensors file::

    layers.{i}.weight         [E, H] fp32
    layers.{i}.bias           [E]    fp32
    layers.{i}.mean_log_norm  [E]    fp32
    layers.{i}.expert_r2      [E]    fp32   (optional: held-out R^2 of each expert)
    layers.{i}.similarity     [E, E] fp32   (optional: expert-output cosine similarity)
    __metadata__              every entry of ``metadata``, its value JSON-encoded

The file is written byte-for-byte deterministically (sorted tensor names, sorted metadata keys), so the
same calibration gives the same file; any safetensors reader opens it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

FORMAT = "base_moe.predictors"
FORMAT_VERSION = 2
"""The newest file version this base_moe reads. A file is version 2 when it holds ``similarity`` (which version 1
readers do not know), else version 1."""

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16"}


def model_type(model: torch.nn.Module) -> str:
    """``model.config.model_type`` (``"unknown"`` for a model without a config)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or "unknown")


class Predictors:
    """Per-layer log-norm predictors and calibration statistics (see the module docstring)."""

    def __init__(
        self,
        weight: dict[int, torch.Tensor],
        bias: dict[int, torch.Tensor],
        mean_log_norm: dict[int, torch.Tensor],
        r2: dict[int, float] | None = None,
        metadata: dict[str, Any] | None = None,
        expert_r2: dict[int, torch.Tensor] | None = None,
        similarity: dict[int, torch.Tensor] | None = None,
    ) -> None:
        layers = sorted(weight)
        expert_r2 = expert_r2 or {}
        similarity = similarity or {}
        if not layers:
            raise ValueError("predictors need at least one layer (got no weight)")
        if sorted(bias) != layers or sorted(mean_log_norm) != layers:
            raise ValueError(
                f"weight, bias and mean_log_norm must name the same layers; got {layers}, {sorted(bias)}, "
                f"{sorted(mean_log_norm)}"
            )
        for i in layers:
            if weight[i].dim() != 2 or weight[i].shape[1] != weight[layers[0]].shape[-1]:
                first = "" if i == layers[0] else f", layer {layers[0]} {tuple(weight[layers[0]].shape)}"
                raise ValueError(
                    f"every layer's weight must be [experts, hidden_size] with one hidden size; layer {i} has "
                    f"{tuple(weight[i].shape)}{first}"
                )
            E, _ = weight[i].shape
            if bias[i].shape != (E,) or mean_log_norm[i].shape != (E,):
                raise ValueError(
                    f"layer {i}: weight is {tuple(weight[i].shape)}, so bias and mean_log_norm must be [{E}]; got "
                    f"{tuple(bias[i].shape)} and {tuple(mean_log_norm[i].shape)}"
                )
            if not all(bool(torch.isfinite(t).all()) for t in (weight[i], bias[i], mean_log_norm[i])):
                raise ValueError(f"layer {i}: the predictor holds NaN or infinite values")
            if i in expert_r2 and expert_r2[i].shape != (E,):
                raise ValueError(f"layer {i}: expert_r2 must be [{E}], got {tuple(expert_r2[i].shape)}")
            if i in similarity and (similarity[i].shape != (E, E) or not bool(torch.isfinite(similarity[i]).all())):
                raise ValueError(f"layer {i}: similarity must be a finite [{E}, {E}] matrix, got "
                                 f"{tuple(similarity[i].shape)}")
        for name, extra in (("r2", r2 or {}), ("expert_r2", expert_r2), ("similarity", similarity)):
            if not set(extra) <= set(layers):
                raise ValueError(f"{name} names layers {sorted(set(extra) - set(layers))} that have no predictor")
        self.weight = {i: weight[i].float().contiguous() for i in layers}
        self.bias = {i: bias[i].float().contiguous() for i in layers}
        self.mean_log_norm = {i: mean_log_norm[i].float().contiguous() for i in layers}
        self.expert_r2 = {i: t.float().contiguous() for i, t in sorted(expert_r2.items())}
        self.similarity = {i: t.float().contiguous() for i, t in sorted(similarity.items())}
        self.r2 = {i: float((r2 or {}).get(i, math.nan)) for i in layers}
        self.metadata: dict[str, Any] = dict(metadata or {})
        if self.metadata.get("format", FORMAT) != FORMAT:  # kept, it would make a file that load() refuses
            raise ValueError(f"metadata 'format' names the file format, {FORMAT!r}; got {self.metadata['format']!r}")
        self.metadata.update(self._format_fields())
        self.stats: dict[str, Any] = {}
        """Run statistics of the calibration that made these predictors (time, memory); not saved."""

    def _format_fields(self) -> dict[str, Any]:
        """The metadata the file format owns, derived from the predictors: save() writes them over the caller's."""
        return {"format": FORMAT, "format_version": FORMAT_VERSION if self.similarity else 1, "layers": self.layers,
                "r2": {str(i): float(v) for i, v in self.r2.items()}}

    # -----------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        """The decoder-layer indices that have a predictor, ascending."""
        return list(self.weight)

    @property
    def num_experts(self) -> dict[int, int]:
        """Per layer (as in :attr:`layers`), the number of routed experts its predictor scores."""
        return {i: w.shape[0] for i, w in self.weight.items()}

    @property
    def hidden_size(self) -> int:
        """The model's hidden size, the predictors' input width."""
        return next(iter(self.weight.values())).shape[1]

    def to(self, device: torch.device | str | torch.dtype | None = None,
           dtype: torch.dtype | None = None) -> Predictors:
        """A copy with every tensor moved to ``device`` / cast to ``dtype``; as with ``torch.Tensor.to``, a dtype may
        come first (``predictors.to(torch.float64)``)."""
        if isinstance(device, torch.dtype):
            if dtype is not None:
                raise TypeError("to() got a dtype both positionally and as dtype=")
            device, dtype = None, device
        if dtype is not None and not dtype.is_floating_point:  # an int cast would truncate the fit
            raise TypeError(f"predictors hold real-valued fits: to() takes a floating dtype, got {dtype}")

        def move(d: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {i: t.to(device=device, dtype=dtype) for i, t in d.items()}

        out = Predictors.__new__(Predictors)
        out.weight, out.bias = move(self.weight), move(self.bias)
        out.mean_log_norm, out.expert_r2 = move(self.mean_log_norm), move(self.expert_r2)
        out.similarity = move(self.similarity)
        out.r2, out.metadata, out.stats = dict(self.r2), dict(self.metadata), dict(self.stats)
        return out

    def __repr__(self) -> str:
        r2 = ", ".join(f"{i}: {v:.3f}" for i, v in self.r2.items())
        return (
            f"Predictors(model_type={self.metadata.get('model_type')!r}, layers={len(self.weight)}, "
            f"experts={sorted(set(self.num_experts.values()))}, hidden_size={self.hidden_size}, r2={{{r2}}})"
        )

    # -----------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as the file names them."""
        out = {}
        for i in self.layers:
            out[f"layers.{i}.weight"] = self.weight[i]
            out[f"layers.{i}.bias"] = self.bias[i]
            out[f"layers.{i}.mean_log_norm"] = self.mean_log_norm[i]
            if i in self.expert_r2:
                out[f"layers.{i}.expert_r2"] = self.expert_r2[i]
            if i in self.similarity:
                out[f"layers.{i}.similarity"] = self.similarity[i]
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the predictors as a safetensors file (deterministic bytes; see the module docstring)."""
        metadata = {**self.metadata, **self._format_fields()}
        _write_safetensors(path, self.tensors(), {k: json.dumps(v, sort_keys=True) for k, v in metadata.items()})

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> Predictors:
        """Read a file written by :meth:`save`, its tensors onto ``device`` (default the CPU)."""
        from safetensors import SafetensorError, safe_open

        device = torch.device(device)  # a bad device is the caller's error, not the file's
        if os.path.isdir(path):  # (safetensors' own error names no path)
            raise ValueError(f"{path}: a directory, not a predictors file")
        try:
            with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
                raw = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except SafetensorError as err:  # a truncated file, or not safetensors at all
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
        try:
            metadata = {k: json.loads(v) for k, v in raw.items()}
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a base_moe predictors file (metadata is not JSON: {err})") from None
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a base_moe predictors file (metadata format={metadata.get('format')!r})")
        if not isinstance(metadata.get("format_version"), int):
            raise ValueError(f"{path}: predictors format_version must be an int, "
                             f"got {metadata.get('format_version')!r}")
        if metadata["format_version"] > FORMAT_VERSION:
            raise ValueError(
                f"{path}: predictors format version {metadata['format_version']} is newer than this base_moe "
                f"understands ({FORMAT_VERSION}); upgrade base_moe"
            )
        fields: dict[str, dict[int, torch.Tensor]] = {
            "weight": {}, "bias": {}, "mean_log_norm": {}, "expert_r2": {}, "similarity": {}
        }
        for name, tensor in tensors.items():
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isascii() or not parts[1].isdigit() \
                    or parts[2] not in fields:
                raise ValueError(f"{path}: unexpected tensor {name!r} in a predictors file")
            fields[parts[2]][int(parts[1])] = tensor
        try:
            r2 = {int(i): float(v) for i, v in metadata.get("r2", {}).items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"{path}: metadata r2 must map layer numbers to numbers, got {metadata['r2']!r}") from None
        try:
            return cls(fields["weight"], fields["bias"], fields["mean_log_norm"], r2, metadata, fields["expert_r2"],
                       fields["similarity"])
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    # -----------------------------------------------------------------------------------------
    def check_compatible(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` naming every difference between these predictors and ``model``'s MoE layers
        (model type, hidden size, expert count, layer set)."""
        from .layouts import find_moe_layouts

        layouts = find_moe_layouts(model)
        problems = []
        ours = self.metadata.get("model_type")
        theirs = model_type(model)
        if ours is not None and ours != theirs:
            problems.append(f"model type: predictors are for {ours!r}, the model is {theirs!r}")
        found = {layout.layer_index: layout for layout in layouts}
        if sorted(found) != self.layers:
            problems.append(f"MoE layers: predictors have {_ranges(self.layers)}, the model has {_ranges(sorted(found))}")
        sizes = {layout.hidden_size for layout in layouts}
        if sizes and sizes != {self.hidden_size}:
            problems.append(f"hidden size: predictors have {self.hidden_size}, the model has {sorted(sizes)}")
        experts = [
            f"layer {i}: {self.weight[i].shape[0]} vs {found[i].num_experts}"
            for i in self.layers
            if i in found and self.weight[i].shape[0] != found[i].num_experts
        ]
        if experts:
            more = " ..." if len(experts) > 4 else ""
            problems.append("expert count (predictors vs model): " + ", ".join(experts[:4]) + more)
        if problems:
            source = self.metadata.get("model_name_or_path")
            where = f" (calibrated on {source})" if source else ""
            raise ValueError(
                "predictors do not match this model" + where + ":\n  " + "\n  ".join(problems)
                + "\nRe-run base_moe.calibrate(model, ...) (or `python -m base_moe calibrate`) for this model."
            )


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: short layer lists in messages."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file with sorted names and sorted metadata keys.

    ``safetensors.torch.save_file`` orders ``__metadata__`` by a randomised hash map, so identical inputs give
    different bytes from run to run; the format itself is simple enough to write directly: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, then the raw tensor data.
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot save tensor {name!r} of dtype {t.dtype}")
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)
