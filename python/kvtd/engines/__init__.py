"""The engine wing: one package per engine kvtd serves, over the core (Session, Geometry,
places) and the wing's shared rank layer (rank.py).

Rules (tests/scripts/rooms_test.py reads them): an engine's package imports the core and
`engines.rank` only, never another engine; each states once, in its __init__, the upstream
revision it is written against. The names engines' own configs load (kvtd.fastdeploy,
kvtd.fastdeploy_v1, kvtd.sglang, kvtd.vllm) are aliases of these modules, kept at the top.
A fifth engine is a new folder here, its tests a new folder under tests/python/.
"""
