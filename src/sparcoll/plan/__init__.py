"""ByteComp's planner: a strategy per tensor (compressor, collective, where compression runs) chosen
from profiled costs by a timeline simulator. `options` is the decision tree and its pruning rules,
`timeline` the simulator, `decide` the decision algorithm."""
