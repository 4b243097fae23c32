"""`ogrpo.overlap`: the server generates while the trainer trains (`lossless`, `one-step`). The mechanism
(pipeline.py: lookahead, tickets, streamed groups), the trainer's layer that runs it (steps.py, streaming.py), the
checkpoint of the generation stream (resume.py) and one-step's ZeRO-3 push (zero3_push.py). The planner decides
the mode and whether batches stream (ogrpo/planner/overlap_stream.py); the trainer reads its decision. Importing
this package imports no library."""
