// Emulation: the runtime API is part of hip_runtime.h here.
#pragma once
#include "hip_runtime.h"
