"""Model files: everything ``drl export`` writes and ``drl predict --model`` reads.

- ``drlfile.py``: ``.drl``, the model's tensors and spec in one safetensors file (any method,
  rebuilt with drl itself).
- ``graph.py``: the serving graph (the network and its scoring as one module) and its spec;
  ``torchformats.py`` (TorchScript ``.pt``, torch.export ``.pt2``) and ``onnx.py`` write and read it.
- ``formats.py``: every format by name, for writing a graph and loading any model file.
- ``modelfile.py``: what a model file must prove (its name's format, checksums, spec fields).
"""
