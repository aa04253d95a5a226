"""Planning and pricing: pure functions and small objects (no torch, no MPI).

The role table (`roles`), the switch plan (`switchplan`), where work goes (`placement`, `stealing`,
`migration`), the cost model and its hardware profiles (`costmodel`, `hardware`, `calibrate`), the
prediction of the coming iterations (`prediction`, `pricing`) and the split policies (`policy`).
The runtime executes what these decide; the simulator prices the same plans.
"""
