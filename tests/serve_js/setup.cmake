# The serve_js fixture (tests/CMakeLists.txt): copies the test package of tests/serve_js into DEST
# and installs its locked packages there with `npm ci`, once per lock file (a stamp holds the
# lock's hash), so the source tree gets no node_modules and each build directory has its own.
# cmake -DSRC=tests/serve_js -DDEST=build/serve_js -DNPM=npm -P setup.cmake
file(MAKE_DIRECTORY ${DEST})
file(GLOB files RELATIVE ${SRC} ${SRC}/*.mjs)
foreach(name IN LISTS files ITEMS package.json package-lock.json)
  file(COPY_FILE ${SRC}/${name} ${DEST}/${name} ONLY_IF_DIFFERENT)
endforeach()
file(SHA256 ${SRC}/package-lock.json lock_hash)
set(stamp ${DEST}/node_modules/.e4kv-lock-sha256)
if(EXISTS ${stamp})
  file(READ ${stamp} installed)
  if(installed STREQUAL lock_hash)
    return()
  endif()
endif()
execute_process(COMMAND ${NPM} ci --prefix ${DEST} --no-audit --no-fund --prefer-offline
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "npm ci --prefix ${DEST} failed (${rc}); it needs the npm registry or a "
                      "filled npm cache")
endif()
file(WRITE ${stamp} ${lock_hash})
