"""NoteBank: sparse episodic notes over the recurrent (GDN) layers' keys (SPEC 7).

The algorithm, numpy only:
  config      NoteBankConfig, NoteBankError
  writer      key distinctiveness, span selection, the sparse projection, BF16 notes
  addressing  query vectors, per-channel similarity, the summed and vote rankers, top-R
  measures    storage in bytes (notes vs KV caches), coverage of known token ranges
The model glue:
  glue        capture runs, branches (snapshot/restore), NoteBank.write/retrieve/replay
The experiment:
  demo        the needle document, run_demo, the report table
  cli         ``python -m spel_mlx.notebank demo``
Arrows run one way: cli -> demo -> glue -> (measures, addressing) -> writer -> config.
Decisions the spec leaves open are written down in docs/notebank.md.
"""
from .addressing import (Retrieval, address, channel_similarity, channel_votes, query_vectors,
                         rank_summed, rank_votes)
from .config import QUERY_SOURCES, RANKERS, NoteBankConfig, NoteBankError
from .demo import Needle, format_table, needle_document, run_demo, toy_config, toy_model
from .glue import Branch, NoteBank, WriteReport, feed, run_captured
from .measures import (NOTE_HEADER_BYTES, containment, contains, dense_kv_bytes, gdn_channel_count,
                       hit_at_r, hybrid_kv_bytes, native_payload_bytes, note_bytes, notes_storage_bytes,
                       recurrent_state_bytes, token_rank)
from .writer import (Note, NoteWriter, from_bf16_bits, key_distinctiveness, position_scores,
                     select_spans, span_key, sparse_projection, to_bf16_bits, unit)

# the public API: the names a user of NoteBank needs, wherever they live
__all__ = [
    "Retrieval", "address", "channel_similarity", "channel_votes", "query_vectors",
    "rank_summed", "rank_votes", "QUERY_SOURCES", "RANKERS", "NoteBankConfig", "NoteBankError",
    "Needle", "format_table", "needle_document", "run_demo", "toy_config", "toy_model",
    "Branch", "NoteBank", "WriteReport", "feed", "run_captured", "NOTE_HEADER_BYTES",
    "containment", "contains", "dense_kv_bytes", "gdn_channel_count", "hit_at_r",
    "hybrid_kv_bytes", "native_payload_bytes", "note_bytes", "notes_storage_bytes",
    "recurrent_state_bytes", "token_rank", "Note", "NoteWriter", "from_bf16_bits",
    "key_distinctiveness", "position_scores", "select_spans", "span_key", "sparse_projection",
    "to_bf16_bits", "unit",
]
