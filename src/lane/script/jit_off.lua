-- Layer: lane. Switches LuaJIT's trace compiler off (`script_limits.jit: false`).
jit.off()
jit.flush()
if jit.status() then error("LuaJIT's compiler could not be switched off") end
