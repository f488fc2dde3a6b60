"""The frozen pre-trained ViT (the PTM): building it from timm with weights from a local file, the
Hugging Face cache (``hf-hub:`` names) or a seeded random init, checking it is a plain ViT, its
fingerprint, the parts of its forward the networks reuse (``backbone.py``), the hub cache
(``hub.py``) and the record a run keeps of it (``record.py``)."""
