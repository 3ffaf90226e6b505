// What the AMX kernels share (prompt_attention_amx.cpp, amx_linear.cpp): the tile configuration and Linux's
// permission for the tile state. Include only where the build has AMX (__AMX_TILE__).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace lora_serve {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..count-1 as 16 rows of 64 bytes, for the calling thread (each worker thread configures its own).
inline void configure_tiles(int count) {
  TileConfig config;
  for (int i = 0; i < count; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}

// Linux hands the tile state to a process that asks for it (once per process).
inline bool tiles_granted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

}  // namespace lora_serve
