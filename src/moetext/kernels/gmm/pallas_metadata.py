"""The group visit schedule moved to `moetext.kernels.pallas_common`, next to the index maps and
kernel steps that read it (the bf16 and FP8 kernels share all three). Kept for old imports."""

from moetext.kernels.pallas_common import GroupMetadata, cdiv, make_group_metadata, max_visits

__all__ = ["GroupMetadata", "cdiv", "make_group_metadata", "max_visits"]
