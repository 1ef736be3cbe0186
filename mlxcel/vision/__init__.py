"""The vision stage of VLMs (docs/vision.md): image loading, per-family preprocessing
(processors/), vision towers, projectors and the EmbedMerger."""
