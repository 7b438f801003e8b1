"""The storage format, pure: keys, manifest models, schema, signing, Adler-32, codecs,
dtype names. numpy only: no torch, no store I/O (``import deltastore.format`` imports
no torch)."""
