-- dp_mpi.lua: prints whether this build has MPI (tests/dist/dp_check.sh skips without it)
print(require("tide").C.tide_mpi_available() ~= 0 and "mpi available" or "no mpi")
return { run = function() return 0 end }
