"""fp8 checkpoints as people have them: load them into FP8Linear layers, write them back, export merged DoRA models
(load_fp8_checkpoint, save_fp8_checkpoint, export_merged, detect_format, load_single_file). The layouts (`format=`):
layouts.py and docs/CHECKPOINTS.md; what each module here does: docs/ARCHITECTURE.md, "dorafp8/checkpoint/"."""

from .layouts import DENSE_FORMATS, FORMATS, LAYOUTS, TRANSFORMERS_FORMATS, CheckpointFormatError
from .load import load_fp8_checkpoint
from .reports import ExportReport, LoadReport
from .single_file import load_single_file
from .source import detect_format
from .write import export_merged, save_fp8_checkpoint

__all__ = ["load_fp8_checkpoint", "save_fp8_checkpoint", "export_merged", "detect_format", "LoadReport",
           "ExportReport", "CheckpointFormatError", "load_single_file", "FORMATS", "DENSE_FORMATS", "TRANSFORMERS_FORMATS", "LAYOUTS"]
