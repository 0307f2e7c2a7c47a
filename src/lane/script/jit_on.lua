-- Layer: lane. Checks LuaJIT's trace compiler is on (`script_limits.jit: true`).
if not jit.status() then error("LuaJIT's compiler is not available on this machine") end
