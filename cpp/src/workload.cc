#include "zellige/workload.h"
