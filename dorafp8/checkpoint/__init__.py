"""fp8 checkpoints as people have them: load them into FP8Linear layers, write them back, export merged DoRA models.

Public API:
    load_fp8_checkpoint(model, path_or_state_dict, format="auto")  -> LoadReport
    save_fp8_checkpoint(model, path, format=None)                  -> ExportReport   (no merging)
    export_merged(model, path, format=None)                        -> ExportReport   (DoRA/LoRA adapters merged in)
    detect_format(path_or_state_dict)                              -> (format, what it saw)
    load_single_file(diffusers_model, path)                        -> LoadReport  (original layouts: ldm, BFL, ...)

The layouts (`format=`) are in layouts.py; docs/CHECKPOINTS.md has where each comes from and how it was checked.

The modules, each importing only those above it:
    layouts.py      LAYOUTS, the format names and aliases, CheckpointFormatError
    files.py        files from strangers read safely (paths, headers, JSON), folders published atomically
    modules.py      a model's tensors and fp8 layers, putting tensors and modules in place (and back: ModelState)
    plan.py         the typed records a load or a write carries (SourceInfo: what a model was loaded from)
    reports.py      LoadReport, ExportReport
    source.py       reading a dict / .safetensors file / sharded directory; detect_format
    load_plan.py    where every checkpoint tensor goes, checked before any data is read
    load.py         load_fp8_checkpoint
    sink.py         the shard writer; emit.py: the tensors of a model in a layout; configs.py: config.json
    write.py        save_fp8_checkpoint, export_merged, the state dict for transformers' save_pretrained
    from_transformers.py  from_transformers_fp8 (a transformers fp8 model -> FP8Linear layers)
    save_hooks.py   transformers' and diffusers' save_pretrained of a model with fp8 layers
    single_file.py  load_single_file (original-layout single files through diffusers' converters), and the refusal
                    of diffusers' from_single_file of scaled fp8 files
    hf_quantizer.py DoRAFP8Config (imports transformers: loaded on first use, never from here)
    kohya_names.py, kohya.py  save_kohya_dora / load_kohya_dora, DoRA adapters as kohya / LyCORIS files (imports
                    PEFT: loaded on first use by dorafp8.save_kohya_dora / load_kohya_dora, never from here)
"""

from .layouts import DENSE_FORMATS, FORMATS, LAYOUTS, TRANSFORMERS_FORMATS, CheckpointFormatError
from .load import load_fp8_checkpoint
from .reports import ExportReport, LoadReport
from .single_file import load_single_file
from .source import detect_format
from .write import export_merged, save_fp8_checkpoint

__all__ = ["load_fp8_checkpoint", "save_fp8_checkpoint", "export_merged", "detect_format", "LoadReport",
           "ExportReport", "CheckpointFormatError", "load_single_file", "FORMATS", "DENSE_FORMATS", "TRANSFORMERS_FORMATS", "LAYOUTS"]
