"""The engine, in rooms along the data's path (see docs/architecture.md).

Ground floor, each module its own face: ``comm`` (every collective), ``compat``
(torch versions), ``mesh``, ``offload``, ``trace``, ``common`` (small shared
types), ``presentation`` (what a front end shows for a shard) and ``settings``
(what a front end decides about a unit). Rooms, each with a face (its
``__init__``): ``gather/`` (with ``gather/codec/``), ``reduce/``, ``unit/``,
``step/``. ``manage`` is the engine's entry point for the front ends, which
resolve their arguments first (one ``MeshInfo``, ``UnitConfig``).
"""
