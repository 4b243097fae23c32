"""The per-stage profiler: the stage table, `pad_share`, memory and the split placement's timeline
(profiler.py), its layers of the trainer class (hooks.py) and the timeline picture (timeline.py). Importing this
package imports no library."""
