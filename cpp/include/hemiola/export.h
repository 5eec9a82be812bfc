// Symbol visibility: the library is built with hidden visibility; only what is
// marked HEMIOLA_API is exported.
#pragma once

#if defined(HEMIOLA_BUILDING)
#define HEMIOLA_API __attribute__((visibility("default")))
#else
#define HEMIOLA_API
#endif
