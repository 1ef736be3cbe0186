"""The vision stage of VLMs (SPEC.md section 7): image loading, per-family preprocessing
(processors/), vision towers, projectors and the EmbedMerger."""
