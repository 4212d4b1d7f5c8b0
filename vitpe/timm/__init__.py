"""The timm wing: every bridge between vitpe and timm, in one place.

- :mod:`.interop`: a timm ViT with a vitpe PE (:func:`equip_timm_vit`), Swin-V2's position MLP as ``cpb``
  (:func:`cpb_from_swinv2`);
- :mod:`.convert`: timm's ViTs as vitpe models (:func:`vit_from_timm`, :func:`load_timm_state_dict`);
- :mod:`.models`: vitpe's ViTs in timm's registry (``timm.create_model("vitpe_...")``), registered when timm is imported;
- :mod:`.pretrained`: timm's file layout (``config.json`` + ``model.safetensors``): :func:`save_pretrained`,
  :func:`from_pretrained`.

Importing this wing does not import timm: each bridge imports it where it is used, so vitpe's PE modules cost torch
alone. The core (coordinates, PEs, the model) never imports the wing.
"""
from .convert import convert_timm_state_dict, load_timm_state_dict, timm_architecture, timm_pos_embed, vit_from_timm
from .interop import cpb_from_swinv2, equip_timm_vit, fold_prefix_positions, unwrap
from .models import ARCHITECTURES, timm_model_names
from .pretrained import exported_run, from_pretrained, is_exported, preprocessing, save_pretrained

__all__ = ["equip_timm_vit", "cpb_from_swinv2", "fold_prefix_positions", "unwrap", "vit_from_timm", "timm_architecture",
           "timm_pos_embed", "convert_timm_state_dict", "load_timm_state_dict", "ARCHITECTURES", "timm_model_names",
           "save_pretrained", "from_pretrained", "preprocessing", "is_exported", "exported_run"]
