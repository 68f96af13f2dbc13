"""What a run leaves: CSV and JSON sidecar files written whole (files), the pictures
(plots), and the terminal's tables and progress (render)."""

from blockscope.results.files import check_out_dir, sidecar, write_outputs

__all__ = ["check_out_dir", "sidecar", "write_outputs"]
